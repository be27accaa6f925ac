import pytest

from torchpar.config import help_text, load_config, to_toml
from torchpar.errors import ConfigError
from torchpar.models import model_args


def write(path, text):
    path.write_text(text)
    return path


def test_extends_chain_and_child_overrides(tmp_path):
    write(tmp_path / "base.toml", '[training]\nsteps = 10\nseq_len = 64\n[optimizer]\nlr = 0.1\n')
    write(tmp_path / "mid.toml", 'extends = "base.toml"\n[training]\nsteps = 20\n')
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "leaf.toml", 'extends = "../mid.toml"\n[optimizer]\nlr = 0.5\n')
    cfg = load_config(tmp_path / "sub" / "leaf.toml")
    assert (cfg.training.steps, cfg.training.seq_len, cfg.optimizer.lr) == (20, 64, 0.5)


def test_cycle_is_rejected_with_the_chain(tmp_path):
    write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match=r"cycle: .*a\.toml -> .*b\.toml -> .*a\.toml"):
        load_config(tmp_path / "a.toml")


def test_cli_overrides_both_forms_are_typed(tmp_path):
    cfg = load_config(
        None,
        ["--training.steps", "7", "--optimizer.lr=0.25", "--metrics.enable_wandb", "true",
         "--metrics.wandb_tags", "a,b", "--parallelism.pipeline_parallel_layers_per_stage", "3,5"],
    )
    assert cfg.training.steps == 7 and cfg.optimizer.lr == 0.25 and cfg.metrics.enable_wandb is True
    assert cfg.metrics.wandb_tags == ["a", "b"] and cfg.parallelism.pipeline_parallel_layers_per_stage == [3,
                                                                                                           5]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trainig.steps", "3"], "unknown section \\[trainig\\]. Did you mean 'training'"),
        (["--training.stpes", "3"], "unknown key 'stpes' in \\[training\\]. Did you mean 'steps'"),
        (["--training.steps", "ten"], "training.steps: got 'ten' \\(str\\), expected int"),
        (["--parallelism.zero_stage", "4"], "zero_stage = 4 is not one of \\[0, 1, 2, 3\\]"),
        (["--training.steps"], "has no value"),
        (["stray"], "unexpected argument"),
        (["--optimizer.lr", "-1"], "optimizer.lr must be >= 0, got -1.0"),
        (["--optimizer.beta2", "1"], "optimizer.beta2 must be in \\[0, 1\\), got 1.0"),
        (["--lr_scheduler.min_lr_ratio", "2"], "min_lr_ratio must be in \\[0, 1\\]"),
        (["--validation.steps", "0"], "validation.freq and validation.steps must be positive"),
        (["--validation.enable", "true", "--data.dataset", "files", "--data.path", "x.txt"],
         "validation.path is required"),
    ],
)
def test_user_mistakes_give_one_clear_error(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, args)


def test_the_model_registry_checks_family_and_flavour():
    """The loader knows no model family (it imports nothing above the errors); the registry
    checks [model] name and flavor when the model's args are made (preflight, the planner)."""
    with pytest.raises(ConfigError, match="Did you mean 'debug'"):
        model_args(load_config(None, ["--model.flavor", "debgu"]).model)
    with pytest.raises(ConfigError, match="model.name = 'llama9'.*Did you mean 'llama3'"):
        model_args(load_config(None, ["--model.name", "llama9"]).model)


def test_wrong_type_in_file_names_field_value_and_type(tmp_path):
    write(tmp_path / "c.toml", '[training]\nseq_len = "long"\n')
    with pytest.raises(ConfigError, match=r"training.seq_len: got 'long' \(str\), expected int"):
        load_config(tmp_path / "c.toml")
    write(tmp_path / "d.toml", '[optimiser]\nlr = 1.0\n')
    with pytest.raises(ConfigError, match="Did you mean 'optimizer'"):
        load_config(tmp_path / "d.toml")


def test_print_config_round_trips(tmp_path):
    cfg = load_config(None, ["--training.steps", "11", "--metrics.wandb_tags", "x"])
    write(tmp_path / "dump.toml", to_toml(cfg))
    again = load_config(tmp_path / "dump.toml")
    assert again == cfg


def test_help_lists_every_field_with_its_docstring():
    text = help_text()
    assert "--training.global_batch_size (int, default 0): Sequences per optimizer step" in text
    assert "--parallelism.zero_stage" in text and "--metrics.wandb_project" in text


def test_every_model_field_reaches_a_familys_args_and_yes_no_fields_may_stay_unset(tmp_path):
    """A [model] field is a shape override by name: every one (but the family, flavour and
    tokenizer) is a field of some family's args, so none parses and does nothing; a yes/no field is
    unset (the flavour's), true or false, and a family without it refuses it in one line; an unset
    field leaves the printed config (TOML has no null) and reads back unset."""
    import dataclasses

    from torchpar.config.sections import Model
    from torchpar.models import MODELS, NOT_SHAPE

    read = {f.name for family in MODELS.values() for f in dataclasses.fields(family.args_class)}
    assert {f.name for f in dataclasses.fields(Model)} - set(NOT_SHAPE) <= read
    assert model_args(load_config(None, ["--model.qk_norm", "true"]).model).qk_norm is True
    moe = ["--model.name", "moe"]
    assert model_args(load_config(None, [*moe, "--model.qk_norm", "false"]).model).qk_norm is False
    assert model_args(load_config(None, moe).model).qk_norm  # (the flavour's, Qwen3's)
    with pytest.raises(ConfigError, match="model.attn_sink does not apply to the gpt2 family; leave it"):
        model_args(load_config(None, ["--model.name", "gpt2", "--model.attn_sink", "false"]).model)
    cfg = load_config(None, ["--model.attn_sink", "true", "--model.attn_sink", "unset"])
    assert cfg.model.attn_sink is None and "attn_sink" not in to_toml(cfg)
    write(tmp_path / "dump.toml", to_toml(cfg))
    assert load_config(tmp_path / "dump.toml") == cfg
    with pytest.raises(ConfigError, match="model.attn_sink: got 'maybe'"):
        load_config(None, ["--model.attn_sink", "maybe"])
