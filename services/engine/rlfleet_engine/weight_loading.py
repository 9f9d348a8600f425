"""Puts new weights into a live model, checking everything before changing anything.

Two sources: a Hugging Face checkpoint's safetensors (a complete state, `load_state_into`), and
the tensors of one distributed update (any subset of the model's tensors, `copy_tensors_into`).
A load that does not fit (unknown or missing tensors, wrong shapes, no files) raises InvalidInput
and leaves the model exactly as it was, so the engine keeps serving its previous version.
`parameter_names` and `missing_parameters` say whether a set of names covers the model (tied
parameters once): a whole checkpoint must, and so must a version sent in several updates, which
the distributed path checks across them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from rlfleet.errors import InvalidInput
from rlfleet_engine.config import blank_path_problem

logger = logging.getLogger(__name__)


def read_safetensors_dir(model_path: str) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in `model_path` (a single file or shards)."""
    problem = blank_path_problem("model_path", model_path)
    if problem is not None:  # Path("") is the working directory, whose files it would otherwise load
        raise InvalidInput(problem)
    directory = Path(model_path)
    if not directory.is_dir():
        raise InvalidInput(f"model_path {model_path!r} is not a directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InvalidInput(f"model_path {model_path!r} holds no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:  # cut short, not safetensors at all, unreadable
            raise InvalidInput(
                f"model_path {model_path!r}: {file.name} is not a readable safetensors file ({exc})"
            ) from exc
    return state


def check_shapes(model: torch.nn.Module, shapes: Iterable[tuple[str, tuple[int, ...]]], source: str) -> None:
    """Raises InvalidInput unless every (name, shape) is a tensor of `model` with that shape."""
    targets = model.state_dict(keep_vars=True)
    given = list(shapes)
    unknown = sorted(name for name, _ in given if name not in targets)
    if unknown:
        raise InvalidInput(f"{source} holds tensors the model does not have: {unknown[:5]}")
    for name, shape in given:
        want = tuple(targets[name].shape)
        if tuple(shape) != want:
            raise InvalidInput(f"{source}: tensor {name} has shape {tuple(shape)}, the model expects {want}")


def parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Every name under which `model` takes a parameter, mapped to the parameter it sets (as `named_parameters`
    names it): tied names (lm_head.weight beside model.embed_tokens.weight) map to one, so a state provides that
    parameter under either. Buffers are left out: no load needs to bring them."""
    canonical = {id(param): name for name, param in model.named_parameters()}
    return {
        name: canonical[id(tensor)]
        for name, tensor in model.state_dict(keep_vars=True).items()
        if id(tensor) in canonical
    }


def missing_parameters(parameters: Mapping[str, str], names: Iterable[str]) -> list[str]:
    """The parameters of `parameters` (`parameter_names` of a model) that `names` provides under none of their
    names, sorted."""
    provided = {parameters[name] for name in names if name in parameters}
    return sorted(set(parameters.values()) - provided)


def load_state_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> int:
    """Copies a complete state into `model` in place; returns the number of tensors copied."""
    check_shapes(model, ((name, tuple(t.shape)) for name, t in state.items()), source)
    missing = missing_parameters(parameter_names(model), state)
    if missing:
        raise InvalidInput(f"{source} lacks tensors the model needs: {missing[:5]}")
    return copy_tensors_into(model, state, source)


def copy_tensors_into(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], source: str) -> int:
    """Copies some of the model's tensors (cast to the model's dtype); returns how many. Checks shapes first."""
    check_shapes(model, ((name, tuple(t.shape)) for name, t in tensors.items()), source)
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].copy_(tensor.to(targets[name].dtype))
    logger.info("loaded %d tensors from %s", len(tensors), source)
    return len(tensors)
