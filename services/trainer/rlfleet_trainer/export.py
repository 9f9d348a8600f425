"""Hugging Face export of a checkpoint: safetensors, config and tokenizer, loadable with
AutoModelForCausalLM and servable by the engines.

    python -m rlfleet_trainer export --checkpoint DIR --base-model DIR --out DIR [--tokenizer DIR]
        [--max-shard-size 5GB]

The architecture comes from the base model's config (a checkpoint holds tensors, not a config); only
the policy's tensors are read from the checkpoint, whatever the sharding it was saved with. The base's
generation_config.json (its end-of-turn token ids, its sampling defaults) is kept, with every tokenizer
file of the run's tokenizer (`--tokenizer`: the run's model.tokenizer_path when it set one, else the
base). The tensors are written in the base's dtype (a bfloat16 base is exported in bfloat16, half the
bytes of the fp32 the trainer keeps), which config.json names, in safetensors files of at most
`--max-shard-size` with their model.safetensors.index.json.

Every policy tensor of the checkpoint is exported or the export is refused: a base with fewer layers, or one that
ties tensors the checkpoint holds apart, would give a model missing part of what was trained. PPO's critic head is
not exported (the checkpoint keeps it beside the policy). The model is built on the meta device and given memory
without initialising it (every tensor is read from the checkpoint), so it holds the policy once, in fp32 (4 bytes a
parameter), and logs each phase.

A write is staged under a name of its writer's (`weights.staging_dir`); what an export that was killed left staged
(its process gone) is deleted by the next export to the same --out.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from rlfleet_trainer.checkpoint import CheckpointFailed, load_model_weights
from rlfleet_trainer.directory_swap import place_directory, sync_path, sync_tree
from rlfleet_trainer.shard_size import DEFAULT_MAX_SHARD_SIZE, parse_shard_size
from rlfleet_trainer.weights import base_dtype, stage_model_dir, tokenizer_files, writer_gone

logger = logging.getLogger(__name__)

LAST_MOVED = ("model.safetensors.index.json", "config.json")
"""Moved into an existing --out after every other file, the index after its shards and config.json last: a directory
that a crash left part-filled lacks what a loader reads first, instead of looking like a whole model."""
STAGED_INSIDE = "export"
"""An existing --out (a mount point: nothing can be renamed onto it) is staged in `.export.tmp-<writer>` inside it."""


def export_checkpoint(
    checkpoint: Path,
    base_model: Path,
    out: Path,
    tokenizer: Path | None = None,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Writes the policy of `checkpoint` as the Hugging Face directory `out` (new, or an empty directory, which
    may be a mount point) with the tokenizer at `tokenizer` (by default the base's), in safetensors files of at most
    `max_shard_size` (bytes, or `5GB`, `500MiB`), and returns it."""
    shard_bytes = parse_shard_size(max_shard_size)
    out = out.resolve()
    _remove_left_behind(out)
    # A model written over another's files would be loaded with what those leave: vLLM reads the shards an old
    # model.safetensors.index.json names.
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} is not an empty directory; choose another --out")
    into = out.is_dir()
    if not (base_model / "config.json").exists():
        raise FileNotFoundError(f"--base-model: no Hugging Face model at {base_model} (config.json missing)")
    tokenizer = base_model if tokenizer is None else tokenizer
    if not tokenizer_files(tokenizer):
        option = "--base-model" if tokenizer == base_model else "--tokenizer"
        raise FileNotFoundError(
            f"{option}: no tokenizer files at {tokenizer}; name the run's model.tokenizer_path with --tokenizer"
        )
    if not (checkpoint / ".metadata").exists():
        steps = sorted(path.name for path in checkpoint.glob("step_*") if (path / ".metadata").exists())
        if steps:
            raise FileNotFoundError(
                f"--checkpoint: {checkpoint} holds checkpoints ({', '.join(steps)}), not one: name one"
            )
        raise FileNotFoundError(f"--checkpoint: no checkpoint at {checkpoint} (its .metadata file is missing)")
    started = time.monotonic()
    config = AutoConfig.from_pretrained(str(base_model))
    logger.info("export: building the %s model of %s in float32, uninitialised", config.model_type, base_model)
    model = _uninitialised_model(config)
    logger.info("export: reading the policy's weights of %s", checkpoint)
    try:
        load_model_weights(checkpoint, model)
    except RuntimeError as exc:  # CheckpointFailed among them
        if isinstance(exc, CheckpointFailed) and exc.damaged:
            raise ValueError(f"checkpoint {checkpoint} is damaged, restore it from a copy: {exc}") from exc
        raise ValueError(
            f"{checkpoint} does not hold the weights of the {config.model_type} model at {base_model}: {exc}"
        ) from exc
    dtype = getattr(torch, base_dtype(base_model) or "", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        torch.nn.Module.to(model, dtype)  # transformers' own `to` is typed as unbound
    size_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    shards = f"files of at most {max_shard_size}"
    logger.info("export: writing %.2f GB of %s tensors, in %s, to %s", size_gb, model.dtype, shards, out)
    if into:
        written = _write_into(out, model, tokenizer, base_model, shard_bytes)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = stage_model_dir(model, out, tokenizer, base_dir=base_model, max_shard_size=shard_bytes)
        try:
            place_directory(staged, out)  # an --out made since it was checked is not replaced
        except FileExistsError as exc:
            shutil.rmtree(staged, ignore_errors=True)
            raise FileExistsError(f"{out} was made while the model was exported; choose another --out") from exc
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        written = out
    logger.info("export: wrote %s in %.0f s", written, time.monotonic() - started)
    return written


def _uninitialised_model(config: PretrainedConfig) -> PreTrainedModel:
    """The causal LM of `config` in fp32 (the dtype the trainer trains and checkpoints in), on the CPU with memory
    that is not initialised: built on the meta device, where initialising costs nothing, then given memory. Every
    tensor a state dict holds is then read from the checkpoint (DCP refuses one that lacks any); a non-persistent
    buffer (a rotary embedding's inv_freq) is left as it is, which nothing reads before the model is written, and
    save_pretrained leaves out. Built on the CPU, the random initialisation of every weight took minutes on a
    large model."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # `to_empty` gives every module its own tensor, so a parameter held under two names (tied embeddings) would
    # become two: the names after the first are pointed at the first's again.
    first: dict[int, str] = {}
    tied: list[tuple[str, str]] = []
    for name, parameter in model.named_parameters(remove_duplicate=False):
        earlier = first.setdefault(id(parameter), name)
        if earlier != name:
            tied.append((name, earlier))
    model.to_empty(device="cpu")
    for name, earlier in tied:
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, model.get_parameter(earlier))
    return model


def _remove_left_behind(out: Path) -> None:
    """Deletes what exports to `out` that can no longer finish staged: beside it when it was new, inside it when it
    was an empty directory. A killed export left a copy of the model there (GBs), and inside `out` made it a
    directory that holds files, which every later export refused. A writer still alive keeps its own."""
    places = [(out.parent, f".{out.name}.tmp-"), (out, f".{STAGED_INSIDE}.tmp-")]
    for folder, prefix in places:
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            if entry.name.startswith(prefix) and writer_gone(entry.name.removeprefix(prefix)):
                logger.warning("export: deleting %s, left by an export that did not finish", entry)
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def _write_into(out: Path, model: PreTrainedModel, tokenizer: Path, base_model: Path, max_shard_size: int) -> Path:
    """Writes the model into the empty directory `out`, which stays where it is (a volume mounted there cannot be
    renamed): written beside its files, inside it, then moved in (LAST_MOVED last). A failure takes out what was
    moved and what was staged, leaving `out` as it was."""
    staged = stage_model_dir(model, out / STAGED_INSIDE, tokenizer, base_dir=base_model, max_shard_size=max_shard_size)
    entries = sorted(
        staged.iterdir(), key=lambda entry: LAST_MOVED.index(entry.name) if entry.name in LAST_MOVED else -1
    )
    moved: list[Path] = []
    try:
        if any(entry != staged for entry in out.iterdir()):
            raise FileExistsError(f"{out} was written to while the model was exported; choose another --out")
        sync_tree(staged)  # its files on disk before config.json names them a model
        for entry in entries:
            os.replace(entry, out / entry.name)
            moved.append(out / entry.name)
        staged.rmdir()
        sync_path(out)
    except BaseException:
        for entry in [*moved, staged]:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        raise
    return out
