"""Load and save targets (Hugging Face layout) and DFlash drafters (z-lab layout) from safetensors.

A local directory is used as is; anything else is taken as a hub id and fetched with
``huggingface_hub.snapshot_download`` (offline, that fails with a ``CheckpointError`` saying so). Models are built
on the meta device and the checkpoint tensors are assigned straight in the requested dtype and device, so a
checkpoint is held in memory once. Every mismatch between the checkpoint and the config fails loudly, naming the
tensor or field, because a silently half-loaded model produces fluent garbage that looks like a drafter problem.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ddtree.errors import CheckpointError
from ddtree.models.config import DrafterConfig, TargetConfig
from ddtree.models.drafter import DFlashDrafter
from ddtree.models.target import TargetModel

# Tensors some exporters add that carry no weights we need (RoPE tables are recomputed from the config).
_HARMLESS_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def resolve_checkpoint(path_or_id: str | Path) -> Path:
    """A local directory, or the hub snapshot of ``path_or_id`` downloaded on demand."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {str(path)!r} is a file; pass the model directory instead")
        return path
    text = str(path_or_id)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(
            f"checkpoint {text!r} does not exist locally and is not a hub id (owner/name); check the path"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(snapshot_download(repo_id=text, allow_patterns=_DOWNLOAD_PATTERNS))
    except (OSError, ValueError, HfHubHTTPError) as exc:
        raise CheckpointError(
            f"checkpoint {text!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"({type(exc).__name__}: {exc}); when offline, download it first or pass a local directory"
        ) from None


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: config.json is missing; is this a Hugging Face model directory?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def _parse(from_hf_dict: Callable[[dict[str, Any]], Any], directory: Path) -> Any:
    try:
        return from_hf_dict(_read_config(directory))
    except CheckpointError as exc:
        raise CheckpointError(f"{directory}: {exc}") from None


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (single file or sharded index)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map'")
        files = {name: directory / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise CheckpointError(f"{index}: lists shard {file.name!r}, which is missing from {directory}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(
        f"{directory}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints "
        "are supported)"
    )


def _load_into(model: nn.Module, directory: Path, rename: Callable[[str], str | None], dtype: torch.dtype,
               device: torch.device | str, what: str) -> None:
    """Check every checkpoint tensor against ``model`` (built on meta) and assign it; ``rename`` maps a
    checkpoint name to a parameter name, or None to skip a tensor the model legitimately does not have."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    files = _tensor_files(directory)
    found: dict[str, tuple[str, Path]] = {}
    unexpected = []
    for ck_name, file in files.items():
        name = rename(ck_name)
        if name is None or ck_name.endswith(_HARMLESS_SUFFIXES):
            continue
        if name not in expected:
            unexpected.append(ck_name)
        else:
            found[name] = (ck_name, file)
    missing = sorted(set(expected) - set(found))
    if missing:
        shown = ", ".join(f"{n} {list(expected[n])}" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{what} checkpoint {directory}: missing tensor(s) {shown}{more}")
    if unexpected:
        raise CheckpointError(
            f"{what} checkpoint {directory}: unexpected tensor(s) {sorted(unexpected)[:8]}; the config does not "
            "describe them (a different architecture or a config/weights mismatch)"
        )
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, (_, file) in found.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                ck_name = found[name][0]
                shape = tuple(f.get_slice(ck_name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"{what} checkpoint {directory}: tensor {ck_name!r} has shape {list(shape)}, the config "
                        f"expects {list(expected[name])}"
                    )
                state[name] = f.get_tensor(ck_name).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)


def load_target(path_or_id: str | Path, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> TargetModel:
    """A Qwen3/Qwen2/Llama target from a Hugging Face directory or hub id, in ``dtype`` on ``device``."""
    directory = resolve_checkpoint(path_or_id)
    config = _parse(TargetConfig.from_hf_dict, directory)
    with torch.device("meta"):
        model = TargetModel(config)

    def rename(name: str) -> str | None:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            return None  # some exporters write the tied head too; transformers ignores it, so do we
        return name.removeprefix("model.")

    _load_into(model, directory, rename, dtype, device, "target")
    model.rotary.reset(device)
    return model.eval()


def load_drafter(path_or_id: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 block_size: int | None = None) -> DFlashDrafter:
    """A z-lab DFlash drafter. ``block_size`` overrides the trained one (with a warning when larger: positions
    past the trained depth were never trained and draft poorly)."""
    directory = resolve_checkpoint(path_or_id)
    config = _parse(DrafterConfig.from_hf_dict, directory)
    if block_size is not None and block_size != config.block_size:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise CheckpointError(f"block_size override must be an integer >= 2, got {block_size!r}")
        if block_size > config.trained_block_size:
            warnings.warn(
                f"drafter {directory.name} was trained with block_size {config.trained_block_size}; drafting "
                f"{block_size} positions means depths {config.trained_block_size}..{block_size - 1} are untrained",
                stacklevel=2,
            )
        config = config.with_block_size(block_size)
    with torch.device("meta"):
        model = DFlashDrafter(config)
    _load_into(model, directory, lambda name: name.removeprefix("model."), dtype, device, "drafter")
    model.rotary.reset(device)
    return model.eval()


def _save_tensors(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int | None) -> None:
    """Write ``model.safetensors``, or shards plus ``model.safetensors.index.json`` when over the limit."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _export(model: nn.Module, dtype: torch.dtype | None, prefix: Callable[[str], str]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        out[prefix(name)] = (t.to(dtype) if dtype is not None else t).contiguous()
    return out


def _write_config(directory: Path, config: dict[str, Any], dtype: torch.dtype) -> None:
    config = {**config, "torch_dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_target(model: TargetModel, directory: str | Path, *, dtype: torch.dtype | None = None,
                max_shard_bytes: int | None = None) -> None:
    """Save in the Hugging Face layout (``model.``-prefixed names; no ``lm_head`` when tied), loadable by
    transformers' ``AutoModelForCausalLM`` and by :func:`load_target`; sharded above ``max_shard_bytes``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _export(model, dtype, lambda n: n if n.startswith("lm_head.") else f"model.{n}")
    _save_tensors(tensors, directory, max_shard_bytes)
    _write_config(directory, model.config.to_hf_dict(), dtype or model.dtype)


def save_drafter(model: DFlashDrafter, directory: str | Path, *, dtype: torch.dtype | None = None) -> None:
    """Save in the z-lab layout (``config.json`` with ``dflash_config`` + ``model.safetensors``); the trained
    block size is recorded, not a load-time override."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _save_tensors(_export(model, dtype, lambda n: n), directory, None)
    _write_config(directory, model.config.to_hf_dict(), dtype or model.dtype)
