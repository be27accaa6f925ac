"""Loss terms beside the cross-entropy: the z-loss under data, tensor (loss parallel) and pipeline
parallelism equal to one process, and an auxiliary term made on the first pipeline stage reaching
backward there, equal to one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import TINY, assert_matches, run_layouts, spawn_ranks

from torchpar.loss import (
    IGNORE,
    AuxiliaryTerms,
    add_auxiliary_loss,
    auxiliary_terms,
    cross_entropy_sum,
    tokens_ahead,
    training_loss,
)

Z = "--parallelism.zero_stage"
ZLOSS = ["--loss.z_loss", "0.05"]  # large enough to change the run (1e-4 is usual)
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]


def test_z_loss_is_the_squared_normalizer_and_its_gradient():
    """training_loss: the cross-entropy plus z x sum(logsumexp²), with the gradient of that sum; the
    cross-entropy alone and the z term beside it."""
    logits = torch.randn(2, 3, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3))
    loss, ce, z = training_loss(logits, targets, 0.5)
    lse = torch.logsumexp(logits, -1)
    assert torch.allclose(ce, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                                reduction="sum"))
    assert torch.allclose(loss, ce + 0.5 * lse.square().sum())
    assert torch.allclose(z, 0.5 * lse.square().sum())
    assert training_loss(logits, targets)[2] is None
    loss.backward()
    expected = torch.func.grad(lambda x: torch.nn.functional.cross_entropy(
        x.flatten(0, 1), targets.flatten(), reduction="sum") + 0.5 * torch.logsumexp(x, -1).square().sum())(
        logits.detach())
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def test_an_attached_term_gets_its_gradient_through_the_tensor_it_rides_on():
    """add_auxiliary_loss: the tensor passes unchanged; backward through it gives the term the
    step's scale (as the main loss has), so the term's gradient reaches what it was made from;
    outside a step the term is dropped; an undeclared name is refused."""
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x = torch.ones(3, requires_grad=True)
    with auxiliary_terms(("balance",), scale=0.25) as terms:
        y = add_auxiliary_loss(x * 2, "balance", (w ** 2).sum())
        (y.sum() * 0.25).backward()
        with pytest.raises(ValueError, match="not declared"):
            add_auxiliary_loss(x, "other", w.sum())
    assert torch.equal(x.grad, torch.full((3,), 0.5))
    assert torch.allclose(w.grad, 0.25 * 2 * w.detach())  # d(scale * sum w²)/dw
    assert terms.sums["balance"].item() == 14.0
    assert add_auxiliary_loss(x, "balance", w.sum()) is x  # no step: dropped
    assert AuxiliaryTerms(("a", "b"), 1.0).values(torch.zeros(()))[1].item() == 0.0


@pytest.mark.slow
def test_z_loss_in_every_kind_of_layout_equals_one_process():
    """dp 2 (flat ZeRO-1 and FSDP2), tp 2 with loss parallel (the normalizer over a vocab-sharded
    head) and pp 2 train with the z-loss as one process does, and log the same loss/z_loss; the
    z-loss changes the run (so a path that ignored it would fail)."""
    ref = run_layouts(1, {"single": [Z, "0", *ZLOSS], "single_plain": [Z, "0"]})
    runs = run_layouts(2, {"dp2_zero1": ["--training.local_batch_size", "4", Z, "1", *ZLOSS],
                           "dp2_zero3": ["--training.local_batch_size", "4", Z, "3", *ZLOSS],
                           "tp2_sp_lp": ["--parallelism.tensor_parallel_degree", "2", Z, "0", *ZLOSS],
                           "pp2": [*PP2, Z, "0", *ZLOSS]})
    single = ref["single"]
    z = [r["loss/z_loss"] for r in single["logged"] if "loss/z_loss" in r]
    assert len(z) >= 2 and all(v > 0 for v in z)
    plain = ref["single_plain"]["params"]
    moved = max((single["params"][k] - plain[k]).abs().max().item() for k in single["params"])
    assert moved > 1e-3, moved
    for name, run in runs.items():
        # (the token table's rare rows: float noise amplified by Adam, as in the layout tables)
        assert_matches(run, single, per_param={"tok_embeddings.weight": 5e-5})
        logged = [r["loss/z_loss"] for r in run["logged"] if "loss/z_loss" in r]
        assert logged == pytest.approx(z, rel=1e-5), name


def _aux_worker(rank, world, out, overrides):
    """Two steps of the tiny job with an auxiliary term on the embedding's output (the first
    pipeline stage): 1e-3 x the sum of its squares; rank 0 writes the final parameters."""
    import torch.distributed as dist

    from torchpar.config import load_config
    from torchpar.models.llama import LlamaAdapter
    from torchpar.selftest import full_parameters
    from torchpar.train import Trainer

    LlamaAdapter.auxiliary_terms = lambda self, args: ("embedding_l2",)
    cfg = load_config(TINY, [*overrides, "--job.dump_folder", f"{out}/run", "--training.steps", "2",
                             "--validation.enable", "false", "--metrics.log_freq", "1"])
    trainer = Trainer(cfg)
    for part in trainer.model.parts:
        if part.tok_embeddings is not None:
            part.tok_embeddings.register_forward_hook(
                lambda m, args, h: add_auxiliary_loss(h, "embedding_l2", 1e-3 * h.float().square().sum()))
    trainer.train()
    params = full_parameters(trainer.model.parts)
    gathered = [None] * world
    dist.all_gather_object(gathered, params)
    if rank == 0:
        merged = {k: v for p in gathered for k, v in p.items()}
        torch.save(merged, f"{out}/params.pt")
        logged = [json.loads(line) for line in Path(f"{out}/run/metrics.jsonl").read_text().splitlines()]
        Path(f"{out}/terms.json").write_text(json.dumps([r.get("loss/embedding_l2") for r in logged
                                                         if "loss" in r]))


def _aux_run(world: int, overrides: list[str]) -> tuple[dict, list]:
    out = Path(spawn_ranks(_aux_worker, world, overrides))
    try:
        return torch.load(out / "params.pt"), json.loads((out / "terms.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.slow
def test_an_auxiliary_term_of_the_first_pipeline_stage_trains_as_in_one_process():
    """A term made on the first of two pipeline stages (which never sees the loss) gets its
    gradient in that stage's backward: the final parameters and the logged term equal one
    process's, and differ from a run without the term."""
    one, one_terms = _aux_run(1, [Z, "0"])
    two, two_terms = _aux_run(2, [*PP2, Z, "0"])
    assert one.keys() == two.keys()
    for k in one:
        assert (one[k] - two[k]).abs().max().item() <= 1e-5, k
    assert all(t is not None and t > 0 for t in one_terms) and two_terms == pytest.approx(one_terms, rel=1e-5)
    plain = run_layouts(1, {"plain": [Z, "0", "--training.steps", "2", "--validation.enable", "false"]})
    plain = plain["plain"]
    assert (plain["params"]["tok_embeddings.weight"] - one["tok_embeddings.weight"]).abs().max().item() > 1e-4


def test_tokens_ahead_are_the_next_tokens_of_each_position_masked_at_the_window_and_documents():
    """Column j holds token i + 1 + j; beyond the window and, with documents, where token i + j is in
    another document than token i (column 0, the targets, is never masked)."""
    rows = torch.arange(10, 18)[None]  # a window of 7 inputs and their next tokens
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    i = IGNORE
    plain = [[11, 12, 13], [12, 13, 14], [13, 14, 15], [14, 15, 16], [15, 16, 17], [16, 17, i], [17, i, i]]
    masked = [[11, 12, 13], [12, 13, i], [13, i, i], [14, 15, 16], [15, 16, 17], [16, 17, i], [17, i, i]]
    assert tokens_ahead(rows, 2).tolist() == [plain]
    assert tokens_ahead(rows, 2, documents).tolist() == [masked]
    assert torch.equal(tokens_ahead(rows, 0), rows[:, 1:, None])


def _depth_reference(model, x, ahead):
    """Multi-token prediction written out from the model's modules: each depth's summed
    cross-entropy (DeepSeek-V3: depth k joins the previous depth's state with the embedding of token
    i + k, runs its block, and the shared head predicts token i + k + 1)."""
    n, cos, sin = model.args.n_layers, model.rope_cos, model.rope_sin
    h = model.tok_embeddings(x)
    for i in range(n):
        h = model.layers[str(i)](h, cos, sin)
    out = []
    for k in range(1, model.args.mtp_depth + 1):
        depth = model.layers[str(n + k - 1)]
        e = model.tok_embeddings(ahead[..., k - 1].clamp(min=0))
        j = depth.join
        z = j.eh_proj(torch.cat([j.enorm(e), j.hnorm(h)], -1))
        z = z + depth.attention(depth.attention_norm(z), cos, sin)
        h = z + depth.feed_forward(depth.ffn_norm(z))
        logits = model.output(depth.final_norm(h))
        out.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ahead[..., k].flatten(),
                                                     ignore_index=IGNORE, reduction="sum"))
    return out


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_prediction_depths_add_their_cross_entropies_and_train_the_embedding_through_them(family):
    """With ``ahead``, each depth's cross-entropy is counted as written out by hand and joins the
    loss at weight mtp_weight / depths: the gradient of the loss equals that of cross-entropy +
    weight/depths x the depths' sum; without it (evaluation) the logits are the model's alone."""
    from torchpar.models import adapter

    torch.manual_seed(0)
    model = adapter(family).build(adapter(family).args("debug", n_layers=2, mtp_depth=2, mtp_weight=0.5))
    rows = torch.randint(0, 4096, (2, 17))
    x, ahead = rows[:, :-1], tokens_ahead(rows, 2, torch.tensor([[0] * 9 + [1] * 7, [0] * 16]))
    with auxiliary_terms(("mtp1", "mtp2"), scale=1.0) as terms:
        loss, ce, _ = training_loss(model(x, ahead=ahead), ahead[..., 0])
        loss.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    expected = _depth_reference(model, x, ahead)
    assert all(torch.allclose(terms.sums[f"mtp{k}"], e, rtol=1e-5) for k, e in enumerate(expected, 1))
    logits = model(x)  # (no ahead: no depth runs, and none adds a term)
    (torch.nn.functional.cross_entropy(logits.flatten(0, 1), ahead[..., 0].flatten(), reduction="sum")
     + 0.5 / 2 * sum(expected)).backward()
    assert torch.allclose(ce, cross_entropy_sum(logits, ahead[..., 0]))
    for name, p in model.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-6, rtol=1e-4), name
    assert got["layers.3.join.eh_proj.weight"].abs().sum() > 0
    assert got["tok_embeddings.weight"].abs().sum() > 0
