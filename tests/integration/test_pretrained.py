"""Your weights: ``model.pretrained=DIR``, a directory ``save_pretrained`` wrote (made here,
never downloaded). A run starts from exactly the saved model: its step-0 loss is the saved
model's loss on the same batches, computed here in-process. FSDP's case (rank 0 loads,
every rank keeps its shard) is a covering run of tests/integration/test_coverage.py."""

from __future__ import annotations

import pytest
import torch

from sharded_exp.compose import compose
from sharded_exp.errors import ConfigError
from tests.helpers.jobs import launch_job, saved_tiny_hf
from tests.helpers.runs import check_starts_from_saved

PRETRAINED = ["model.seq_len=16", "trainer.batch_size=4", "trainer.log_interval=1", "optimizer.lr=3e-3"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,model,strategy",
    [
        ("gpt2", "hf_gpt2", "ddp"),
        ("gpt2", "hf_gpt2", "zero1"),
        ("llama", "hf_llama", "fsdp"),  # its rotary table is a buffer outside the state dict
        ("bert", "hf_bert", "fsdp_grad_op"),
    ],
)
def test_a_run_starts_from_the_saved_weights(kind, model, strategy, tmp_path_factory, tmp_path):
    saved = saved_tiny_hf(tmp_path_factory, kind)
    result = launch_job([f"model={model}", f"model.pretrained={saved}", f"strategy={strategy}", *PRETRAINED], tmp_path)
    check_starts_from_saved(result)
    assert result["config"]["model"]["pretrained"] == str(saved)


@pytest.mark.slow
def test_custom_hugging_face_class_with_saved_weights(tmp_path_factory, tmp_path):
    saved = saved_tiny_hf(tmp_path_factory, "gpt2")
    result = launch_job(
        ["model=custom", "model._target_=transformers.GPT2LMHeadModel", f"model.pretrained={saved}",
         "data=causal_lm", "+model.seq_len=16", "trainer.batch_size=4", "trainer.log_interval=1"],
        tmp_path,
    )  # fmt: skip
    check_starts_from_saved(result)


# ------------------------------------------------------------------- refusals (in-process)
def _checked(overrides: list[str]):
    from sharded_exp.launch import preflight

    cfg = compose(overrides)
    preflight.check_values(cfg)
    return cfg


def test_a_name_that_is_not_a_local_directory_is_refused():
    with pytest.raises(ConfigError) as err:
        _checked(["model=hf_gpt2", "model.pretrained=openai-community/gpt2"])
    assert str(err.value) == (
        "model.pretrained=openai-community/gpt2 is not a local directory: weights are read only from a directory "
        "written by save_pretrained (nothing is downloaded from the Hugging Face Hub); give the path of such a "
        "directory, or model.pretrained=null for random weights"
    )


def test_a_directory_without_config_or_weights_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError, match=r"not a directory written by save_pretrained: it needs config.json and the "
                       r"weights \(model.safetensors or pytorch_model.bin\); it holds notes.txt"):  # fmt: skip
        _checked(["model=hf_gpt2", f"model.pretrained={tmp_path}"])


def test_weights_of_another_architecture_are_refused(tmp_path_factory):
    saved = saved_tiny_hf(tmp_path_factory, "gpt2")
    with pytest.raises(ConfigError, match=r"holds a gpt2 model \(config.json's model_type\) and "
                       r"model._target_=transformers.BertForTokenClassification builds a bert model"):  # fmt: skip
        _checked(["model=hf_bert", f"model.pretrained={saved}"])


def test_pretrained_needs_a_hugging_face_class(tmp_path_factory):
    saved = saved_tiny_hf(tmp_path_factory, "gpt2")
    with pytest.raises(ConfigError, match=r"model.pretrained needs a Hugging Face model class as model._target_ .*"
                       r"model._target_=tests.helpers.user_models.build is not one"):  # fmt: skip
        _checked(["model=custom", "model._target_=tests.helpers.user_models.build", f"model.pretrained={saved}"])


def test_the_directory_sets_the_architecture_and_the_data_sizes(tmp_path_factory):
    """The prediction builds the saved architecture from config.json alone (meta device,
    no weights read); the task's vocabulary is the saved model's."""
    from sharded_exp.predict.prediction import meta_model

    saved = saved_tiny_hf(tmp_path_factory, "gpt2")
    cfg = _checked(["model=hf_gpt2", f"model.pretrained={saved}", "model.seq_len=16"])
    assert cfg.model.vocab_size == 96 and cfg.model.config.n_embd == 32  # not hf_gpt2's 1000 and 128
    module = meta_model(cfg.model)
    assert all(p.is_meta for p in module.parameters())
    assert module.transformer.wte.weight.shape == (96, 32)
    with pytest.raises(ConfigError, match=r"model.seq_len=64 is longer than model.pretrained's 32 positions"):
        _checked(["model=hf_gpt2", f"model.pretrained={saved}", "model.seq_len=64"])


def test_plain_parameters_fsdp_leaves_whole_keep_their_objects():
    """A 0-dim parameter FSDP does not shard is a plain meta tensor after a meta build;
    materialising it for the rank-0 load keeps its Parameter object (the optimizer's)."""
    from torch import nn

    from sharded_exp.models.materialise import keep_plain_parameters

    with torch.device("meta"):
        module = nn.Module()
        module.scale = nn.Parameter(torch.tensor(2.0))
        module.frozen = nn.Parameter(torch.tensor(1.0), requires_grad=False)
        module.linear = nn.Linear(3, 3)
    before = {name: id(p) for name, p in module.named_parameters()}
    optimizer = torch.optim.SGD([module.scale], lr=0.1)
    keep_plain_parameters(module, torch.device("cpu"))
    assert {name: id(p) for name, p in module.named_parameters()} == before
    assert all(p.device.type == "cpu" for p in module.parameters())
    assert optimizer.param_groups[0]["params"][0] is module.scale and not module.frozen.requires_grad


def test_a_tokenizer_larger_than_the_saved_vocabulary_gets_advice_that_works(tmp_path_factory):
    """model.vocab_size cannot grow a saved model (config.json sets it): the refusal says what
    does, and never 'set model.vocab_size=...', which would be ignored."""
    from sharded_exp.launch import preflight
    from tests.helpers import data_files

    saved = saved_tiny_hf(tmp_path_factory, "gpt2")  # a vocabulary of 96
    files = tmp_path_factory.mktemp("files")
    tok = data_files.train_tokenizer(files / "tok", vocab_size=120)
    text = data_files.write_text(files / "corpus.txt")
    cfg = compose(["model=hf_gpt2", f"model.pretrained={saved}", "model.seq_len=16", "model.vocab_size=120",
                       "data=text_file", f"data.path={text}", f"data.tokenizer={tok}", "trainer.world_size=1"])  # fmt: skip
    with pytest.raises(ConfigError, match="model.vocab_size cannot override") as refused:
        preflight.check(cfg, str(tmp_path_factory.mktemp("out")), peak=False)
    assert "resize_token_embeddings(120)" in str(refused.value) and "set model.vocab_size" not in str(refused.value)


def test_more_labels_than_the_saved_head_gets_advice_that_works(tmp_path_factory):
    """model.num_labels cannot grow a saved model's head either: the refusal names a new head,
    never 'set model.num_labels=...', which the saved config.json would override."""
    from sharded_exp.launch import preflight
    from tests.helpers import data_files

    saved = saved_tiny_hf(tmp_path_factory, "bert")  # a head of 5 labels; CoNLL's tags are 9
    files = tmp_path_factory.mktemp("conll")
    cfg = compose(["model=hf_bert", f"model.pretrained={saved}", "model.seq_len=16", "model.num_labels=9",
                       "data=conll", f"data.path={data_files.write_conll(files / 'train.conll')}",
                       f"data.tokenizer={data_files.train_tokenizer(files / 'tok', vocab_size=96)}",
                       "trainer.world_size=1"])  # fmt: skip
    with pytest.raises(ConfigError, match="model.num_labels cannot override") as refused:
        preflight.check(cfg, str(tmp_path_factory.mktemp("out")), peak=False)
    assert "a new 9-label head" in str(refused.value) and "set model.num_labels" not in str(refused.value)


def test_a_saved_directory_that_changes_after_pre_flight_is_refused_by_the_ranks(tmp_path_factory, tmp_path):
    """The ranks load what the parent checked: a config.json swapped in between is named, not trained."""
    import json
    import shutil

    from sharded_exp.launch import preflight
    from sharded_exp.models.target import build_target_model

    saved = tmp_path / "saved"
    shutil.copytree(saved_tiny_hf(tmp_path_factory, "gpt2"), saved)
    cfg = compose(["model=hf_gpt2", f"model.pretrained={saved}", "model.seq_len=16"])
    checked = preflight.check(cfg, str(tmp_path / "out"), peak=False).config["model"]
    assert build_target_model(checked, weights=True).transformer.wte.weight.shape == (96, 32)
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "n_layer": 3}))  # another model, after the check
    with pytest.raises(ConfigError, match="changed after the job was checked"):
        build_target_model(checked, weights=True)


def test_a_corrupt_safetensors_file_is_named_before_any_rank_starts(tmp_path_factory, tmp_path):
    import shutil

    from sharded_exp.launch import preflight

    saved = tmp_path / "saved"
    shutil.copytree(saved_tiny_hf(tmp_path_factory, "gpt2"), saved)
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    with pytest.raises(ConfigError, match=r"model.safetensors is not a readable safetensors file: its tensors need"):
        preflight.check_values(compose(["model=hf_gpt2", f"model.pretrained={saved}", "model.seq_len=16"]))
    weights.write_bytes(b"\xff" * 64)  # no header at all
    with pytest.raises(ConfigError, match="is not a readable safetensors file: its header claims"):
        preflight.check_values(compose(["model=hf_gpt2", f"model.pretrained={saved}", "model.seq_len=16"]))
