"""Weight versions on disk: each version is a complete Hugging Face model directory.

A version is written to a temporary directory, flushed to disk and renamed into place
(`directory_swap`), so a crash never leaves a half-written `v<N>` that looks complete; engines (or a
restarted trainer) can load any kept version.

A version holds the trainer's fp32 tensors, so an engine computing in fp32 (the CPU engines) serves exactly
the weights trained, and its config.json names the dtype of the model the run started from (bfloat16 for
most LLMs), which an engine with SGLang's `--dtype auto` serves in. Named float32, as transformers writes
it for fp32 tensors, SGLang would serve it in float16 (its rule for float32 configs), whose range a
bf16-trained model can overflow.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import PreTrainedModel

from rlfleet_trainer.directory_swap import replace_directory

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, a SentencePiece tokenizer.model
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",  # chat_template.jinja, chat_template.json
    "vocab*",  # vocab.json (with merges.txt: a BPE tokenizer without tokenizer.json), vocab.txt (WordPiece)
    "merges.txt",
    "*.model",  # spiece.model, sentencepiece.bpe.model, ...
    "*.tiktoken",
    "*.tokenizer",
    "tokenization_*.py",  # the code of a tokenizer the config's auto_map names (trust_remote_code)
)
"""Names (glob patterns) of the files a tokenizer is loaded from, among them every name a transformers tokenizer
class saves its vocabulary under (`vocab_files_names`). A directory's other files (weights, config.json) are not."""
CHAT_TEMPLATE_DIR = "additional_chat_templates"
"""A directory of named chat templates next to the tokenizer (transformers' CHAT_TEMPLATE_DIR)."""
GENERATION_CONFIG = "generation_config.json"
PROCESS_TOKEN = uuid.uuid4().hex[:8]
"""Tells this process's staging directories from those of an earlier process that had the same pid (a restarted
container's trainer is pid 1 again)."""


def without_tied_copies(state: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`state` without the names under which `model` holds a parameter it holds under an earlier name too (tied
    weights: lm_head.weight beside model.embed_tokens.weight), once that earlier name is in `state`.

    The full state FSDP2 gathers holds a copy of a tied parameter under each name, in storages of their own, which
    `unique_tensors` cannot tell apart from two parameters: the model's own state says which names are one."""
    first: dict[int, str] = {}
    out: dict[str, torch.Tensor] = dict(state)
    for name, tensor in model.state_dict(keep_vars=True).items():
        earlier = first.setdefault(id(tensor), name)
        if earlier != name and earlier in state:
            out.pop(name, None)
    return out


def version_dir(weights_root: Path, version: int) -> Path:
    return weights_root / f"v{version}"


def write_model_dir(
    model: PreTrainedModel,
    dest: Path,
    tokenizer_dir: Path,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    *,
    base_dir: Path | None = None,
    untied: bool = False,
) -> Path:
    """Writes `model` (safetensors + config) and the tokenizer files of `tokenizer_dir` as the
    Hugging Face directory `dest`, replacing it atomically. `state_dict` replaces the model's own
    tensors: a sharded model passes its gathered full weights.

    `base_dir`, the model the weights were trained from (by default the directory `model` was loaded from): its
    generation_config.json is kept as it is. The one save_pretrained writes is derived from config.json for a
    model made from its config (export), which drops the base's end-of-turn token ids and sampling defaults.

    `untied`: `state_dict` is `without_tied_copies` already, so `model`'s own state is not read. A disk copy written
    in the background beside a training step must not read it: an FSDP2 model's `state_dict()` reshards its
    parameters, which mid-forward would pull them from under the step."""
    tmp = stage_model_dir(model, dest, tokenizer_dir, state_dict, base_dir=base_dir, untied=untied)
    try:
        replace_directory(tmp, dest)  # an existing one is a leftover from a step that was rolled back
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def stage_model_dir(
    model: PreTrainedModel,
    dest: Path,
    tokenizer_dir: Path,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    *,
    base_dir: Path | None = None,
    untied: bool = False,
    max_shard_size: int | None = None,
) -> Path:
    """Writes what `write_model_dir` puts at `dest` into a new directory beside it (`staging_dir`) and returns that
    directory, not yet flushed to disk; a failure deletes it. `max_shard_size`: bytes a safetensors file holds at
    most (None: transformers' default), more in more files with their model.safetensors.index.json."""
    tmp = staging_dir(dest)
    tmp.mkdir(parents=True)  # with the umask's mode, as the directory engines read
    try:
        _write_staged(
            model, tmp, tokenizer_dir, state_dict, base_dir=base_dir, untied=untied, max_shard_size=max_shard_size
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def staging_dir(dest: Path) -> Path:
    """A new name beside `dest` to write it under, `.<name>.tmp-<pid>-<PROCESS_TOKEN>-<id>`: named for its writer, as
    a disk copy given up at its bound may still be writing the same version as the run resumed after it; and for
    its process, so what a crash left can be told apart (`writer_gone`)."""
    return dest.parent / f".{dest.name}.tmp-{os.getpid()}-{PROCESS_TOKEN}-{uuid.uuid4().hex[:12]}"


def _write_staged(
    model: PreTrainedModel,
    tmp: Path,
    tokenizer_dir: Path,
    state_dict: Mapping[str, torch.Tensor] | None,
    *,
    base_dir: Path | None,
    untied: bool,
    max_shard_size: int | None,
) -> None:
    tensors: dict[str, torch.Tensor] | None = None
    if state_dict is not None:
        # save_pretrained would keep both names of a tied parameter.
        tensors = dict(state_dict) if untied else without_tied_copies(state_dict, model)
    written_dtype = None if tensors is None else floating_dtype_name(tensors)  # save_pretrained empties `tensors`
    if max_shard_size is None:
        model.save_pretrained(str(tmp), state_dict=tensors, safe_serialization=True)
    else:
        model.save_pretrained(str(tmp), state_dict=tensors, safe_serialization=True, max_shard_size=max_shard_size)
    for source in tokenizer_files(tokenizer_dir):
        shutil.copy2(source, tmp / source.name)
    if (tokenizer_dir / CHAT_TEMPLATE_DIR).is_dir():
        shutil.copytree(tokenizer_dir / CHAT_TEMPLATE_DIR, tmp / CHAT_TEMPLATE_DIR)
    base = base_dir if base_dir is not None else Path(model.name_or_path) if model.name_or_path else None
    if base is not None and (base / GENERATION_CONFIG).is_file():
        shutil.copy2(base / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
    # Named from the tensors written when the base names none: save_pretrained names the dtype of the model's
    # parameters as it finds them, which a step training beside a background copy may hold in bf16 (FSDP's
    # mixed precision) while the tensors written are fp32.
    dtype = base_dtype(base) if base is not None else None
    if dtype is None:
        dtype = written_dtype
    if dtype is not None:
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = dtype  # transformers writes the tensors' own (float32)
        # And under the key transformers read before 4.56 (later ones read it as dtype too): an engine on an older
        # one (vLLM, SGLang) found none, took the model for float32 and served it in float16.
        config["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def base_dtype(model_dir: Path) -> str | None:
    """The dtype the Hugging Face model at `model_dir` names in its config.json (None: none, or no config)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return dtype if isinstance(dtype, str) and dtype != "auto" else None


def floating_dtype_name(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The dtype of the first floating-point tensor of `tensors` as config.json names it ("float32"); None
    without one."""
    for tensor in tensors.values():
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return None


def tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    """The files of `tokenizer_dir` a tokenizer is loaded from (TOKENIZER_FILES), by name."""
    if not tokenizer_dir.is_dir():
        return []
    found = {path for pattern in TOKENIZER_FILES for path in tokenizer_dir.glob(pattern) if path.is_file()}
    return sorted(found)


def save_version(
    model: PreTrainedModel,
    weights_root: Path,
    version: int,
    tokenizer_dir: Path,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    *,
    untied: bool = False,
) -> Path:
    """Writes `model` (or `state_dict` in its shape) as weight version `version`; returns its directory.
    `untied`: see `write_model_dir`."""
    return write_model_dir(model, version_dir(weights_root, version), tokenizer_dir, state_dict, untied=untied)


def prune_versions(weights_root: Path, keep_from: int) -> None:
    """Deletes published versions older than `keep_from` and what writes of them left; of the versions kept, what
    writes that can no longer finish left (`left_behind`). A crash mid-write of the newest version left a copy of the
    weights beside it (GBs on a real model) that otherwise stayed until that version was pruned, steps later, or
    never for a run's last version."""
    for path in weights_root.glob("*v*"):
        name = path.name.removeprefix(".").split(".", 1)[0]  # v3, .v3.tmp-x, .v3.replaced-x: v3
        if name[:1] != "v" or not name[1:].isdigit():
            continue
        if int(name[1:]) < keep_from or left_behind(path, weights_root / name):
            shutil.rmtree(path, ignore_errors=True)


def left_behind(path: Path, dest: Path) -> bool:
    """Whether `path`, a directory a write of the version `dest` made beside it, is one that no writer will finish
    or delete: a staging directory whose writer is gone, or the old version a replace set aside once the new one is
    in place (its replacer only deletes it then, and tolerates it gone). Without its replacement in place, the one
    set aside is the only whole copy of the version (a crash between the two renames): kept."""
    stage = path.name.split(".", 2)[-1]  # tmp-<writer>-<id>, replaced-<id>; a version's own name: itself
    if stage.startswith("replaced-"):
        return dest.is_dir()
    return stage.startswith("tmp-") and writer_gone(stage.removeprefix("tmp-"))


def writer_gone(writer: str) -> bool:
    """Whether the writer a staging directory names (`<pid>-<PROCESS_TOKEN>-<id>`) can no longer be writing it: an
    earlier process that had this one's pid, or a pid no process on this machine has. A name without a writer (one
    staged before writers were named), a writer in this process, and any process alive here are kept: it may still
    write. One trainer writes a run's weights, so a writer on another machine sharing the storage is not looked for.
    """
    parts = writer.split("-", 2)
    if len(parts) != 3 or not parts[0].isdigit():
        return False
    pid, token = int(parts[0]), parts[1]
    if pid == os.getpid():
        return token != PROCESS_TOKEN
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
