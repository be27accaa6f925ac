"""Where numbers go: the console (one line per logged step or evaluation), ``metrics.jsonl`` and wandb.

Only the logging rank writes; every figure it writes is already global (all-reduced) or says
which rank it belongs to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsLogger:
    def __init__(self, cfg, dump_folder: str, enabled: bool, run_config: dict):
        """``cfg`` is the [metrics] section; ``enabled`` is False on non-logging ranks."""
        self.enabled = enabled
        self.wandb = None
        self.path = Path(dump_folder) / "metrics.jsonl"
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")
        if cfg.enable_wandb:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb_project, name=cfg.wandb_run_name or None, tags=list(cfg.wandb_tags) or None,
                dir=str(self.path.parent), config=run_config, mode=os.environ.get("WANDB_MODE"),
            )

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(
                {k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"]
            )
        if "loss" in record:
            mem = record.get("mem_max_allocated_gib", record.get("mem_rss_gib", 0.0))
            print(
                f"step {record['step']:>5}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  "
                f"lr {record['lr']:.2e}  tok/s {record['tokens_per_sec']:,.0f}  mfu "
                f"{100 * record['mfu']:.2f}%  mem {mem:.2f}GiB  elapsed {record['elapsed_s']:.1f}s",
                flush=True,
            )
        if "val_loss" in record:
            print(
                f"step {record['step']:>5}  val_loss {record['val_loss']:.4f}  val_ppl "
                f"{record['val_ppl']:.2f}",
                flush=True,
            )

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
