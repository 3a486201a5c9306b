"""XTokenizer over a SentencePiece model (e.g. Mistral's, with byte fallback)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from xtoken_core import envs
from xtoken_core.tokenizers.base import ROLE_SPECIAL, XTokenizer

logger = logging.getLogger(__name__)


def _num_threads() -> int:
    """Threads of a batch encode: 1 when ``TOKENIZERS_PARALLELISM`` is off, else all cores.

    One switch for both backends: Hugging Face ``tokenizers`` reads the same variable, so a
    collator worker process that sets it to ``false`` tokenizes on one core with either.
    """
    return 1 if envs.tokenizers_parallelism_off() else -1


class SentencePieceTokenizer(XTokenizer):
    """A SentencePiece ``.model`` with exact byte spans (via the ``sentencepiece`` library).

    Token bytes: ``▁`` -> space, ``<0xHH>`` byte-fallback pieces -> that byte, control and
    unknown pieces -> b"". ``encode`` adds BOS (as Mistral models expect) when
    ``add_special_tokens`` is True. The dummy-prefix ``▁`` covers no byte of the text (see
    ``spans.py``). SentencePiece reads a literal ``▁`` in the text as a space; such tokens are
    placed by SentencePiece's own byte offsets.
    """

    def __init__(self, model_file: str | Path, name: str | None = None) -> None:
        """Load a SentencePiece model file.

        Args:
            model_file: path to the serialized model.
            name: display name (defaults to the path).

        Raises:
            ValueError: if the file is missing or not a SentencePiece model.
        """
        import sentencepiece as spm

        path = Path(model_file)
        if not path.is_file():
            raise ValueError(f"SentencePiece model {str(path)!r} does not exist")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as exc:
            raise ValueError(f"cannot load {str(path)!r} as a SentencePiece model: {exc}") from exc
        self.name = name or str(path)
        self.path = path  # the source file (hf_export.py converts it for transformers)
        self.vocab_size = int(self._sp.get_piece_size())
        sp = self._sp

        def opt(i: int) -> int | None:
            return None if i < 0 else int(i)

        self.bos_id, self.eos_id, self.pad_id = opt(sp.bos_id()), opt(sp.eos_id()), opt(sp.pad_id())
        self._model_bytes = path.read_bytes()
        self._dummy_prefix = self._reads_dummy_prefix(self._model_bytes)
        self._plain = None
        self._plain_lock = threading.Lock()
        token_bytes: list[bytes] = []
        roles = np.zeros(self.vocab_size, dtype=np.int8)
        for tid in range(self.vocab_size):
            piece = sp.id_to_piece(tid)
            if sp.is_control(tid) or sp.is_unused(tid):
                token_bytes.append(b"")
                roles[tid] = ROLE_SPECIAL
            elif sp.is_unknown(tid):
                token_bytes.append(b"")  # stands for text we cannot name: spans come from offsets
            elif sp.is_byte(tid):
                token_bytes.append(bytes([int(piece[3:5], 16)]))
            else:
                token_bytes.append(piece.replace("▁", " ").encode("utf-8"))
        self._token_bytes = token_bytes
        self._roles = roles
        self._finish_init()
        logger.info("[tokenizers] loaded %s (vocab_size=%d)", self.name, self.vocab_size)

    @staticmethod
    def _reads_dummy_prefix(model_bytes: bytes) -> bool:
        """Whether the model adds a dummy ``▁`` before the text (SentencePiece's default)."""
        try:
            from sentencepiece import sentencepiece_model_pb2

            proto = sentencepiece_model_pb2.ModelProto()
            proto.ParseFromString(model_bytes)
            return bool(proto.normalizer_spec.add_dummy_prefix)
        except Exception:  # protobuf missing or unusual file: SentencePiece's default
            return True

    def _raw_encode(self, text: str, add_special_tokens: bool):
        return self._raw_encode_batch([text], add_special_tokens)[0]

    def _raw_encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[tuple]:
        # Ids of the whole batch in one native call; the byte offsets (a slower protobuf
        # encoding) are computed only for texts whose token bytes do not spell the text.
        extra = [self.bos_id] if add_special_tokens and self.bos_id is not None else []
        all_ids = (
            self._sp.encode(list(texts), out_type=int, num_threads=_num_threads()) if texts else []
        )
        out = []
        for text, ids in zip(texts, all_ids):
            ids_N = np.asarray(extra + ids, dtype=np.int64)
            out.append((ids_N, lambda text=text: self._offsets(text, len(extra)), False))
        return out

    def _offsets(self, text: str, extra: int) -> np.ndarray:
        """int64 [extra + pieces, 2] SentencePiece's byte offsets (zeros for the BOS rows)."""
        pieces = self._sp.encode(text, out_type="proto").pieces
        offsets_N2 = np.zeros((len(pieces) + extra, 2), dtype=np.int64)
        offsets_N2[extra:] = np.array([(p.begin, p.end) for p in pieces], dtype=np.int64).reshape(
            -1, 2
        )
        return offsets_N2

    @property
    def _plain_sp(self):
        """A second processor of the same model without the dummy prefix (built on first use)."""
        with self._plain_lock:
            if self._plain is None:
                if not self._dummy_prefix:
                    self._plain = self._sp
                else:
                    import sentencepiece as spm
                    from sentencepiece import sentencepiece_model_pb2

                    proto = sentencepiece_model_pb2.ModelProto()
                    proto.ParseFromString(self._model_bytes)
                    proto.normalizer_spec.add_dummy_prefix = False
                    self._plain = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
            return self._plain

    def encode_bytes_to_ids(self, text: str) -> list[int]:
        """Plain tokenization of ``text``: no BOS/EOS and no dummy-prefix ``▁`` (see the base).

        Args:
            text: any string.

        Returns:
            The token ids; with Mistral's identity normalizer their bytes spell ``text``.
        """
        return list(self._plain_sp.encode(text, out_type=int))

    def encode_batch_bytes_to_ids(self, texts: list[str]) -> list[list[int]]:
        """``encode_bytes_to_ids`` of several texts in one native (multi-threaded) call.

        Args:
            texts: the texts.

        Returns:
            One id list per text, in order.
        """
        texts = list(texts)
        return [list(ids) for ids in self._plain_sp.encode(texts, out_type=int)] if texts else []
