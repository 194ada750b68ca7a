"""Pre-flight: everything the parent checks and decides once, before any rank steps (before
any starts, but for what the peak's fake step finds in a job whose ranks start while it is
predicted: :func:`check_in_two`).

:func:`check` runs for the parent (the Hydra job) on the composed config: in the parent, or,
for ``python -m sharded_exp`` spawning its ranks, in a process forked from the rank server
(:mod:`.server_check`), which has imported what it needs by then. It refuses what a
schema cannot express (ranges, a GPU that is not there, a package that is not installed,
a model and task that do not fit, a checkpoint that cannot start this job) with a
:class:`~sharded_exp.errors.ConfigError` that names the bad value and what is allowed,
and decides what the ranks then take as given: the device type, the world size, the
resolved checkpoint paths, the rule gradients are cleared by, and the memory prediction (made here, once, by the function
the planner uses).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.nn.parameter import UninitializedParameter

from sharded_exp.checkpoint import plan_checkpoints
from sharded_exp.compose import registries
from sharded_exp.config import (
    Config,
    JobGroups,
    LoggerConfig,
    OptimizerConfig,
    PathsConfig,
    PrecisionConfig,
    ReportConfig,
    TrainerConfig,
    ZeroGrad,
    check_packages,
    check_ranges,
)
from sharded_exp.config_file import check_head_counts, is_target_model
from sharded_exp.data import TASKS
from sharded_exp.data.loader import check_fits
from sharded_exp.errors import ConfigError, WontFit, closest
from sharded_exp.job.spec import JobSpec, decided_config, this_process
from sharded_exp.launch.layout import Layout
from sharded_exp.measure.machine_memory import available_mib as available_host_mib
from sharded_exp.models import MODELS, build_model, units
from sharded_exp.models.target import (
    check_accepts,
    check_attn_implementation,
    check_config_file,
    check_pretrained,
)
from sharded_exp.optim import OPTIMIZERS
from sharded_exp.precision import PRECISIONS, Precision
from sharded_exp.predict.prediction import meta_model, model_shapes, predict, predict_peak
from sharded_exp.predict.step_time import ensure_profile
from sharded_exp.strategies import STRATEGIES, offloads_to_host
from sharded_exp.train import faults


def _check_param_dtype(cfg: JobGroups) -> None:
    """FSDP's ``strategy.param_dtype`` (the gathered parameters' dtype) beside autocast's: a
    half dtype that is not autocast's gives matmuls of two half dtypes, which torch's kernels
    refuse in every rank ("mixed dtype (CPU): expect parameter to have scalar type of Float")."""
    param = getattr(cfg.strategy, "param_dtype", None)
    autocast = Precision.of(cfg).autocast_dtype
    if param is None or autocast is None or param in ("float32", str(autocast).removeprefix("torch.")):
        return
    half = str(autocast).removeprefix("torch.")
    raise ConfigError(
        f"strategy.param_dtype={param} is not precision={Precision.of(cfg)}'s autocast dtype ({half}): "
        f"autocast would compute in {half} with {param} parameters, which torch refuses; use "
        f"strategy.param_dtype={half} (or null: from precision), or precision=32, where strategy.param_dtype "
        "alone sets the compute dtype"
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def shapes_model(cfg: JobGroups) -> torch.nn.Module:
    """The configured model on the meta device (shapes, no memory); one whose constructor reads
    a value (``Tensor.item()``, an orthogonal parametrization) cannot be built there, and is
    built on the host instead, once: it builds in plain torch, and the ranks build it whole.
    A model that cannot be built at all is refused, with its own complaint."""
    try:
        return meta_model(cfg.model, cfg.trainer.freeze)
    except Exception:  # noqa: BLE001 -- tried on the host: a refused config is refused there again
        pass
    try:
        with torch.device("cpu"):
            return build_model(cfg.model, cfg.trainer.freeze)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- the model's own complaint, named
        raise ConfigError(
            f"model={cfg.model.name} cannot be built with this config: {type(exc).__name__}: {exc}"
        ) from None


def check_no_lazy(module: torch.nn.Module, model: str) -> None:
    """A lazy module's parameter has no shape before a first forward: nothing can be predicted,
    sharded or checkpointed from it. Refused, naming it."""
    for name, param in module.named_parameters():
        if isinstance(param, UninitializedParameter):
            owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
            raise ConfigError(
                f"model={model}: parameter {name} ({type(owner).__name__}) has no shape until a first forward (a lazy "
                "module): sharded_exp predicts, shards and checkpoints from shapes before training; give the module "
                "its sizes (nn.Linear(in, out)), or run one forward in the factory"
            )


def check_units_shardable(module: torch.nn.Module, model: str, strategy: str) -> None:
    """What FSDP cannot wrap, refused before any rank starts (the ranks would die with torch's
    "already managed by another FSDP group" or "Invariant encountered"): a unit listed twice (a
    block reused), a unit inside another, or a parameter shared by two units or by a unit and
    the rest of the model (a tied weight across groups)."""
    found = units(module)
    names: dict[int, str] = {}
    for n, m in module.named_modules(remove_duplicate=False):
        names.setdefault(id(m), n)  # a module reused: its first place
    seen: set[int] = set()
    for unit in found:
        _require(id(unit) not in seen, f"strategy={strategy}: model={model}'s unit {names.get(id(unit))} is listed twice "
                 "(one block reused): FSDP wraps each unit once; use a block per position, or strategy=ddp")  # fmt: skip
        seen.add(id(unit))
    for a in found:
        for b in found:
            if a is not b and any(m is b for m in a.modules()):
                raise ConfigError(
                    f"strategy={strategy}: model={model}'s unit {names.get(id(b))} is inside its unit "
                    f"{names.get(id(a))}: FSDP's units must not nest; return disjoint blocks from sharding_units()"
                )
    owner: dict[int, str] = {}
    for unit in found:
        for name, param in unit.named_parameters():
            key = f"{names.get(id(unit))}.{name}"
            if id(param) in owner and not owner[id(param)].startswith(f"{names.get(id(unit))}."):
                raise ConfigError(
                    f"strategy={strategy}: model={model}'s parameter {key} is also {owner[id(param)]} (one tensor in "
                    "two units): FSDP shards each unit's parameters on their own; untie them, or use strategy=ddp"
                )
            owner.setdefault(id(param), key)
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in owner and not any(_within(name, names.get(id(u))) for u in found):
            raise ConfigError(
                f"strategy={strategy}: model={model}'s parameter {name} is also {owner[id(param)]} (a unit's tensor "
                "tied to one outside the units): FSDP shards the unit's parameters apart from the rest; untie them, "
                "or use strategy=ddp"
            )


def _within(name: str, prefix: str | None) -> bool:
    return prefix is not None and (name == prefix or name.startswith(prefix + "."))


def check(cfg: Config, output_dir: str, layout: Layout | None = None, peak: bool = True) -> JobSpec:
    """Check ``cfg`` and decide the job's device, world size, checkpoints and prediction:
    the job's spec, which the ranks receive. ``cfg`` is read, never changed.

    ``peak``: also predict every rank's peak with a fake training step (a few seconds;
    under torchrun only the rank that writes result.json needs it). Raises ConfigError,
    naming the value and the choices, before anything is started or written.
    """
    spec, peak_of = _checked(cfg, output_dir, layout, peak)
    return _with_peak(spec, peak_of, peak)


def check_in_two(cfg: Config, output_dir: str, peak: bool = True):
    """:func:`check` for a job that spawns its ranks, as a generator. Where the ranks may start
    before the peak is known (:func:`starts_early`), two answers: the spec once the config is
    checked and its model states predicted, its ``wait_for_release`` set and no peak in its
    prediction; then the peak, or the ConfigError that refuses it (host memory). The ranks
    start on the first answer and wait for the second before their first step
    (:mod:`sharded_exp.launch.parent`). Elsewhere one: :func:`check`'s spec, peak and all."""
    spec, peak_of = _checked(cfg, output_dir, None, peak)
    if not peak or not starts_early(spec):
        yield _with_peak(spec, peak_of, peak)
        return
    ensure_profile(spec.device_type, spec.world_size)  # a new machine measures before its ranks start
    yield dataclasses.replace(spec, wait_for_release=True)
    yield peak_of()


def _with_peak(spec: JobSpec, peak_of, peak: bool) -> JobSpec:
    """``spec`` with the peak in its prediction, where ``peak`` asks for it."""
    if peak:
        spec.prediction["peak"] = peak_of()
    return spec


def starts_early(spec: JobSpec) -> bool:
    """Whether a job's ranks may start while its peak is predicted: where, before their first
    step, they read and change nothing outside their run directory (no checkpoint to resume
    or write, no pretrained weights) and hold no more than their model states (no states
    pinned in host memory by offloading, which the host check counts from the peak)."""
    if spec.checkpoint.resume is not None or spec.checkpoint.every or spec.config["model"].get("pretrained"):
        return False
    return not offloads_to_host(OmegaConf.create(spec.config["strategy"]))


def _checked(cfg: Config, output_dir: str, layout: Layout | None, peak: bool):
    """:func:`check`'s spec without the peak, and a function that predicts the peak (and
    refuses it where it does not fit host memory, as it was before any rank started). With
    ``peak``, a CPU job whose model states alone do not fit host memory is refused here
    already: what a rank holds before its first step, where it may start early."""
    cfg = copy.deepcopy(cfg)  # the job's own copy: the caller's stays as composed
    world_size = layout.world_size if layout is not None else cfg.trainer.world_size
    check_values(cfg, world_size)  # (model.pretrained's directory resolves into the copy's model config)
    local_ranks = layout.local_world_size if layout is not None else world_size
    device_type = decide_device(
        str(cfg.trainer.accelerator), local_ranks, Precision.of(cfg), per_task=layout is not None
    )
    strategy = STRATEGIES.builder(cfg.strategy.name)
    strategy.check(cfg.strategy, world_size, device_type)
    _check_param_dtype(cfg)
    zero_grad = strategy.traits.zero_grad_rule(ZeroGrad(cfg.trainer.zero_grad))  # what build_strategy applies
    module = shapes_model(cfg)
    check_no_lazy(module, cfg.model.name)
    if strategy.traits.shards_parameters:
        check_units_shardable(module, cfg.model.name, cfg.strategy.name)
    params = list(module.parameters())
    _require(bool(params), f"model={cfg.model.name} has no parameters: there is nothing to train or to shard")
    _require(
        any(p.requires_grad for p in params),
        f"trainer.freeze={list(cfg.trainer.freeze)} freezes every parameter of model={cfg.model.name}: "
        "nothing would be trained; freeze fewer (e.g. trainer.freeze=[embed*])",
    )
    levers = [f"trainer.activation_checkpointing={t}" for t in [cfg.trainer.activation_checkpointing]
              if t != "none"] + (["trainer.compile=true"] if cfg.trainer.compile else [])  # fmt: skip
    _require(
        not levers or bool(units(module)),
        f"{' and '.join(levers)} {'act' if len(levers) > 1 else 'acts'} on the model's repeated units (blocks), and model={cfg.model.name} has none "
        "(no sharding_units(), no Hugging Face _no_split_modules, no ModuleList or Sequential)",
    )
    shapes = model_shapes(cfg.model, cfg.optimizer, module)
    task = TASKS.builder(cfg.data.name)(cfg.data, cfg.model, 1)  # does the task fit? (one sample: keys, not memory)
    check_accepts(module, list(task(0, 0, 0)), cfg.model.name, cfg.data.name)  # keyword batch in
    if task.dataset is not None:  # a user's data: enough of it for one micro-batch per rank
        check_fits(task, world_size, cfg.trainer.batch_size, cfg.data.name)
    plan = plan_checkpoints(cfg.trainer, strategy.traits.checkpoint_format_auto, output_dir, shapes.state_shapes,
                            cfg.optimizer.name)  # fmt: skip
    # The config the ranks, .hydra/ and W&B see holds the real world size (torchrun, SLURM)
    # and the checkpoint plan's paths; the ranks and the fake step read it typed, as composed.
    config, config_yaml, decided_typed = decided_config(cfg, world_size, plan)
    decided = OmegaConf.structured(decided_typed)
    prediction = predict(decided.strategy, decided.optimizer, Precision.of(decided), shapes, world_size)
    host_check = peak and cfg.trainer.host_memory_check
    available = available_host_mib() if host_check else None  # read before any rank holds some of it
    if host_check and device_type == "cpu":
        states = [sum(parts.values()) for parts in prediction["model_states_mib"]]
        check_host_memory(states, local_ranks, available, "model states alone")

    def peak_of() -> dict:
        predicted = predict_peak(decided, world_size, device_type, prediction, shapes, local_world_size=local_ranks)
        if host_check:
            check_host_memory(host_need_mib(predicted, device_type), local_ranks, available)
        return predicted

    spec = JobSpec(
        config=config,
        config_yaml=config_yaml,
        typed=decided_typed,
        output_dir=output_dir,
        device_type=device_type,
        world_size=world_size,
        params=shapes.params,
        prediction=prediction,
        zero_grad=zero_grad,
        checkpoint=plan,
        launcher=layout.launcher if layout is not None else "spawn",
        **this_process(),
    )
    return spec, peak_of


RANK_OVERHEAD_MIB = 400
"""A CPU rank's memory besides its tensors (the interpreter, torch, its libraries), roughly."""


def host_need_mib(peak: dict, device_type: str) -> list[float] | None:
    """What each rank holds in host memory, as predicted: every tensor's peak on CPU; on CUDA,
    CPU offload's states (None where nothing is offloaded: the host is not checked)."""
    return peak.get("per_rank_mib") if device_type == "cpu" else peak.get("host_mib")


def check_host_memory(
    per_rank_mib: list[float] | None, local_ranks: int, available: float | None, what: str = "predicted"
) -> None:
    """On CPU the ranks' tensors live in host memory, and under CPU offload their states do
    (``per_rank_mib``: each rank's host figure, ``what`` says which; ``available``: the host's
    MiB, read before any rank started): a job predicted not to fit is refused before its ranks
    step (rather than killed by the kernel, or refused pinned memory, a minute later)."""
    if not per_rank_mib or available is None:
        return  # nothing to compare: the run goes on, as when a prediction fails
    need = sum(sorted(per_rank_mib, reverse=True)[:local_ranks]) + RANK_OVERHEAD_MIB * local_ranks
    if need > available:
        raise WontFit(
            f"the job needs about {need:,.0f} MiB of host memory ({local_ranks} rank(s): {what} "
            f"{max(per_rank_mib):,.1f} MiB each plus about {RANK_OVERHEAD_MIB} MiB of process) and {available:,.0f} MiB "
            "are available here; make the batch or the model smaller, run fewer ranks per machine, or set "
            "trainer.host_memory_check=false to start anyway"
        )


def check_values(cfg: JobGroups, world_size: int | None = None) -> None:
    """Names that must be registered, packages that must be there, every group's own ranges
    (:func:`sharded_exp.config.check_ranges`: each group made typed, the bounds the
    registries' schemas declare, a model's sizes; what must divide ``world_size``, the job's,
    where it is known)."""
    try:
        faults.from_env()  # a malformed testing aid fails here, not in every rank
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    strategy = STRATEGIES.builder(cfg.strategy.name)  # raises, naming the registered ones
    check_unread_keys(cfg)
    check_packages(cfg.strategy, strategy.traits.requires)  # a plugin's, stated in its traits only, too
    if not is_target_model(cfg.model):
        MODELS.builder(cfg.model.name)
    TASKS.builder(cfg.data.name)
    retyped(cfg)
    if is_target_model(cfg.model):
        check_config_file(cfg.model)  # a readable config.json (it replaces model.config), or none
        check_attn_implementation(cfg.model)  # a kernel the Hugging Face class has, or null
        check_head_counts(cfg.model)  # heads that divide as the attention's forward needs
        check_pretrained(cfg.model)  # a local save_pretrained directory, never a download
    name = str(cfg.precision.name)
    _require(name in PRECISIONS, f"precision={name!r} is not one of {', '.join(PRECISIONS)}")
    _require(
        cfg.optimizer.name in OPTIMIZERS, f"optimizer.name={cfg.optimizer.name!r} is not one of {', '.join(OPTIMIZERS)}"
    )
    check_ranges(cfg, world_size)  # each group's own ranges, declared bounds and a model's sizes (config.py)


FIXED_GROUPS = {"precision": PrecisionConfig, "optimizer": OptimizerConfig, "trainer": TrainerConfig,
                "logger": LoggerConfig, "paths": PathsConfig, "report": ReportConfig}  # fmt: skip
"""The groups whose schema is one dataclass (the others' is their registered option's); a
training job has all of them, a plan the first three."""


def _schema(group: str, node):
    """The dataclass a group's node is made of; None where it has none (a model of your own)."""
    if group in FIXED_GROUPS:
        return FIXED_GROUPS[group]
    registry = dict(registries()).get(group)
    if registry is None or (group == "model" and is_target_model(node)):
        return None
    return registry.config_class(node.name)


def check_unread_keys(cfg: JobGroups) -> None:
    """A key added on the command line that its group's schema lacks (``+trainer.stepz=3``)
    would be read by nothing: refused, naming the setting meant and the group's settings. A
    model of your own (``model._target_``) takes added keys as its builder's arguments, and a
    custom dataset its factory's under ``data.kwargs``: those are read."""
    for group in ("strategy", "model", "data", *FIXED_GROUPS):
        if group not in cfg:
            continue
        node = cfg[group]
        schema = _schema(group, node)
        if schema is None:
            continue
        settings = [f.name for f in dataclasses.fields(schema)]
        unknown = [k for k in node.keys() if k not in settings]
        if unknown:
            meant = closest(unknown[0], settings)
            which = f"{group}={node.name}" if group in dict(registries()) else group
            raise ConfigError(
                f"{', '.join(f'{group}.{k}' for k in unknown)} is not a setting of {which}, and nothing would read it"
                f"{f'; did you mean {group}.{meant}?' if meant else ''} (its settings: "
                f"{', '.join(s for s in settings if s != 'name')})"
            )


def retyped(cfg: JobGroups) -> None:
    """The strategy, model and data groups made of their registries' own schemas, in place.
    The command line composes them from schemas made again from a cache (no torch there,
    :mod:`sharded_exp.schema_cache`), and they reach pre-flight as plain data; the real
    schemas carry the range checks (``__post_init__``) the typed config runs. A model built
    by ``_target_`` has no schema of its own: left as it is."""
    for group, registry in registries():
        node = cfg[group]
        if group == "model" and is_target_model(node):
            continue
        schema = registry.config_class(node.name)
        if OmegaConf.get_type(node) is schema:
            continue
        values = OmegaConf.to_container(node, resolve=False, enum_to_str=True)  # interpolations kept
        settings = {f.name for f in dataclasses.fields(schema)}
        try:
            typed = OmegaConf.merge(OmegaConf.structured(schema), {k: v for k, v in values.items() if k in settings})
        except OmegaConfBaseException as exc:  # not met after Hydra's own composition with the same types
            key = getattr(exc, "full_key", None)
            raise ConfigError(f"{group}.{key}: {str(exc).splitlines()[0]}" if key else str(exc)) from None
        cfg[group] = typed  # a key added that the schema lacks was refused before (check_unread_keys)


def decide_device(accelerator: str, local_ranks: int, precision_name: str, per_task: bool = False) -> str:
    """'cuda' or 'cpu' for ``trainer.accelerator``, decided once for the whole job.

    ``auto`` means the GPUs when CUDA is available; either way on CUDA each of the
    ``local_ranks`` ranks on this machine needs a GPU of its own. ``per_task``: this
    process is one rank of an external launcher's (torchrun, srun), which may give each
    task its own GPU (``srun --gpus-per-task=1``: one visible GPU per rank, see
    :func:`sharded_exp.launch.rank.rank_device`).
    """
    if accelerator == "gpu":
        _require(
            torch.cuda.is_available(),
            "trainer.accelerator=gpu but CUDA is not available here; use trainer.accelerator=cpu or auto",
        )
    if accelerator == "cpu" or not torch.cuda.is_available():
        return "cpu"
    gpus = torch.cuda.device_count()
    _require(
        local_ranks <= gpus or (per_task and gpus == 1),
        f"trainer.world_size={local_ranks} is more than the {gpus} GPU(s) present (one rank per GPU, "
        f"trainer.accelerator={accelerator}); lower it or use trainer.accelerator=cpu",
    )
    # precision=bf16 is checked by each rank on its own GPU (launch/rank.py::check_bf16):
    # asking here would start a CUDA context in the parent, on GPU 0, for the whole job.
    return "cuda"
