"""A run's tokenizer as a Hugging Face tokenizer folder that ``AutoTokenizer`` loads offline.

The folder encodes text exactly as the ``XTokenizer`` it comes from (same ids, the same
BOS/EOS insertion), with one difference: a special token's text written literally in the input
(``<|im_end|>``) is that special token for transformers, where xtoken reads it as plain text.

* ``tokenizer.json`` sources (Qwen3, DeepSeek, Llama-3, SmolLM2, any local folder): the same
  ``tokenizers`` model, its BOS/EOS/pad named as the xtoken tokenizer resolved them, and the chat
  template of the source folder (``tokenizer_config.json``'s ``chat_template`` or a
  ``chat_template.jinja`` beside it) where it has one.
* SentencePiece models (Mistral): converted by transformers' ``SpmConverter`` from the model's
  own normalizer settings (so the ids are SentencePiece's), a BOS template as
  ``SentencePieceTokenizer.encode`` adds it, control pieces as special tokens.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any

from xtoken_core.tokenizers.base import XTokenizer

logger = logging.getLogger(__name__)

# sentencepiece ModelProto.TrainerSpec.model_type and SentencePiece.type values
_SPM_UNIGRAM, _SPM_BPE = 1, 2
_SPM_CONTROL = 3


def to_transformers(tokenizer: XTokenizer) -> Any:
    """A transformers tokenizer that encodes as ``tokenizer`` does.

    Args:
        tokenizer: an xtoken tokenizer loaded from a tokenizer.json or a SentencePiece model.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` (not yet saved).

    Raises:
        ValueError: a tokenizer of another kind, or a SentencePiece model type that transformers
            cannot convert (names the type).
    """
    from xtoken_core.tokenizers.hf import HFTokenizer
    from xtoken_core.tokenizers.spm import SentencePieceTokenizer

    extra: dict[str, Any] = {}
    if isinstance(tokenizer, HFTokenizer):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(tokenizer.path))
        extra = _folder_settings(Path(tokenizer.path).parent)
    elif isinstance(tokenizer, SentencePieceTokenizer):
        backend, extra = _from_sentencepiece(tokenizer)
    else:
        raise ValueError(
            f"cannot save {tokenizer!r} as a Hugging Face tokenizer: only tokenizer.json and "
            "SentencePiece tokenizers can be; load the run's tokenizer from one of those"
        )
    from transformers import PreTrainedTokenizerFast

    specials = {
        f"{role}_token": backend.id_to_token(tid)
        for role, tid in (
            ("bos", tokenizer.bos_id),
            ("eos", tokenizer.eos_id),
            ("pad", tokenizer.pad_id),
        )
        if tid is not None and backend.id_to_token(tid) is not None
    }
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials, **extra)


def save_hf_tokenizer(
    tokenizer: str | os.PathLike | XTokenizer, out_dir: str | os.PathLike
) -> None:
    """Save a tokenizer into ``out_dir`` so that ``AutoTokenizer.from_pretrained(out_dir)``
    loads it offline (``tokenizer.json``, ``tokenizer_config.json``, the chat template if any).

    Args:
        tokenizer: an ``XTokenizer``, or a name or path for ``load_tokenizer``.
        out_dir: the folder (created if missing).

    Raises:
        ValueError: as ``load_tokenizer`` and ``to_transformers``.
    """
    from xtoken_core.tokenizers.registry import load_tokenizer

    tok = tokenizer if isinstance(tokenizer, XTokenizer) else load_tokenizer(str(tokenizer))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    to_transformers(tok).save_pretrained(str(out))
    logger.info("[tokenizers] saved %s as a Hugging Face tokenizer in %s", tok.name, out)


def _folder_settings(folder: Path) -> dict[str, Any]:
    """The chat template and the length limit of a Hugging Face tokenizer folder."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    out: dict[str, Any] = {}
    template = config.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template:
        out["chat_template"] = template
    if isinstance(config.get("model_max_length"), int):
        out["model_max_length"] = config["model_max_length"]
    return out


def _from_sentencepiece(tokenizer: Any) -> tuple[Any, dict[str, Any]]:
    """A ``tokenizers.Tokenizer`` of a SentencePiece model that gives SentencePiece's ids, and
    its unknown-piece setting."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tokenizer.path).read_bytes())
    kind = proto.trainer_spec.model_type
    if kind == _SPM_BPE:
        vocab: Any = {p.piece: i for i, p in enumerate(proto.pieces)}
    elif kind == _SPM_UNIGRAM:
        vocab = [(p.piece, p.score) for p in proto.pieces]
    else:
        raise ValueError(
            f"{tokenizer.name!r} is a SentencePiece model of type {kind}: only BPE and unigram "
            "models convert to a Hugging Face tokenizer"
        )
    # transformers' converter took ``legacy`` (the pre-fix prefix-space rule, which the
    # SentencePiece encode matches) as a keyword until it became the only behaviour
    legacy = "legacy" in inspect.signature(SpmConverter.build_tokenizer_from_spm_proto).parameters
    backend = SpmConverter.build_tokenizer_from_spm_proto(
        proto, vocab, **({"legacy": True} if legacy else {})
    )
    control = [p.piece for p in proto.pieces if p.type == _SPM_CONTROL]
    backend.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    if tokenizer.bos_id is not None:  # SentencePieceTokenizer.encode adds BOS, nothing else
        bos = proto.pieces[tokenizer.bos_id].piece
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos}:1 $B:1",
            special_tokens=[(bos, tokenizer.bos_id)],
        )
    return backend, {"unk_token": proto.trainer_spec.unk_piece}
