"""The tokenizer interface (XTokenizer), TokenizedText and special-token roles.

Legend: N tokens of one text.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from xtoken_core.tokenizers.spans import PackedTokenBytes, compute_byte_spans

logger = logging.getLogger(__name__)

# Role codes stored in TokenizedText.roles (int8). Content tokens stand for text; the others are
# special/control tokens with empty spans.
ROLE_CONTENT = 0
ROLE_BOS = 1
ROLE_EOS = 2
ROLE_PAD = 3
ROLE_SPECIAL = 4
ROLE_NAMES = {ROLE_BOS: "bos", ROLE_EOS: "eos", ROLE_PAD: "pad", ROLE_SPECIAL: "special"}
ROLE_CODES = {name: code for code, name in ROLE_NAMES.items()}


@dataclass
class TokenizedText:
    """One text tokenized, with the UTF-8 byte span of every token in the original text.

    Attributes:
        ids_N: int64 [N] token ids.
        spans_N2: int64 [N, 2] byte span [start, end) of each token in ``text.encode("utf-8")``.
            Content spans are non-decreasing and tile the bytes they cover; special tokens and
            SentencePiece dummy-prefix pieces have empty spans (start == end).
        roles_N: int8 [N] role codes: ROLE_CONTENT (0), ROLE_BOS, ROLE_EOS, ROLE_PAD,
            ROLE_SPECIAL.
        text: the original text.
    """

    ids_N: np.ndarray
    spans_N2: np.ndarray
    roles_N: np.ndarray
    text: str = field(default="", repr=False)

    @property
    def ids(self) -> np.ndarray:
        """int64 [N] token ids (alias of ``ids_N``)."""
        return self.ids_N

    @property
    def spans(self) -> np.ndarray:
        """int64 [N, 2] byte spans (alias of ``spans_N2``)."""
        return self.spans_N2

    @property
    def roles(self) -> np.ndarray:
        """int8 [N] role codes (alias of ``roles_N``)."""
        return self.roles_N

    def __len__(self) -> int:
        return int(self.ids_N.shape[0])

    def truncated(self, max_tokens: int | None) -> TokenizedText:
        """Return the first ``max_tokens`` tokens (self when None or already short enough).

        Args:
            max_tokens: token cap, >= 0, or None for no cap.

        Returns:
            A TokenizedText sharing the text, with views of the first max_tokens rows.

        Raises:
            ValueError: if max_tokens is negative.
        """
        if max_tokens is None or max_tokens >= len(self):
            return self
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens} must be >= 0 (or None for no cap)")
        return TokenizedText(
            self.ids_N[:max_tokens],
            self.spans_N2[:max_tokens],
            self.roles_N[:max_tokens],
            self.text,
        )


class XTokenizer(ABC):
    """A real tokenizer with exact byte spans, special-token roles and token bytes.

    Subclasses fill ``_token_bytes`` (list: id -> bytes, b"" for special/control tokens) and
    ``_roles`` (int8 [vocab_size] role per id) and implement ``_raw_encode``.

    Attributes:
        name: short name or path it was loaded from.
        vocab_size: every id (added/special tokens included) is < vocab_size.
        bos_id, eos_id, pad_id: special ids, or None where the tokenizer has none.
    """

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    _token_bytes: list[bytes]
    _token_len: np.ndarray
    _roles: np.ndarray
    # SentencePiece adds a dummy "▁" before the text that is no byte of the text.
    _dummy_prefix: bool = False

    def _finish_init(self) -> None:
        """Build the per-id lookup tables once the subclass filled _token_bytes and _roles."""
        self._packed = PackedTokenBytes(self._token_bytes)
        self._token_len = self._packed.len_V
        # Role table: the named special ids win over the generic "special" role (eos over pad).
        for tid, role in (
            (self.pad_id, ROLE_PAD),
            (self.bos_id, ROLE_BOS),
            (self.eos_id, ROLE_EOS),
        ):
            if tid is not None:
                self._roles[tid] = role

    # ---- abstract -------------------------------------------------------------------------
    @abstractmethod
    def _raw_encode(
        self, text: str, add_special_tokens: bool
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """Tokenize one text.

        Returns:
            (ids int64 [N], offsets int64 [N, 2] or a callable returning them,
            offsets_are_chars): the tokenizer's own offsets in the original text (characters or
            bytes). The offsets are read only where the token bytes do not spell the text (a
            normalizer changed it), so a callable lets a backend skip building them.
        """

    @abstractmethod
    def encode_bytes_to_ids(self, text: str) -> list[int]:
        """Plain tokenization of ``text`` as a piece of running text (the projection builder's view).

        No special tokens and no prefix space: SentencePiece's dummy ``▁`` (and a Hugging Face
        Metaspace / Prepend / ByteLevel ``add_prefix_space``) is not added, so ``"ing"`` gives
        the pieces of ``"ing"``, not of ``" ing"``. Wherever the tokenizer does not normalize
        the text (byte-level BPE, SentencePiece with the identity normalizer), the pieces'
        ``token_bytes`` concatenate to exactly ``text.encode("utf-8")``.

        Args:
            text: any string encodable as UTF-8.

        Returns:
            The token ids (empty for "").
        """

    def encode_batch_bytes_to_ids(self, texts: list[str]) -> list[list[int]]:
        """``encode_bytes_to_ids`` of several texts (backends override it to batch natively).

        Args:
            texts: the texts.

        Returns:
            One id list per text, in order.
        """
        return [self.encode_bytes_to_ids(t) for t in texts]

    # ---- public API -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> TokenizedText:
        """Tokenize ``text`` and place every token on the UTF-8 bytes of the original text.

        Special tokens that appear literally in the text are tokenized as ordinary text (never
        recognised as control tokens), so only the tokenizer's own BOS/EOS insertions are special.

        Args:
            text: the text (must be encodable as UTF-8: no lone surrogates).
            add_special_tokens: add the tokenizer's usual specials (its post-processor: e.g. BOS
                for Llama-3 and Mistral, nothing for Qwen3 and DeepSeek).

        Returns:
            TokenizedText with ids [N], spans [N, 2], roles [N].

        Raises:
            ValueError: (UnicodeEncodeError) if the text is not valid Unicode for UTF-8.
        """
        text_bytes = text.encode("utf-8")
        return self._finish_encode(text, text_bytes, *self._raw_encode(text, add_special_tokens))

    def encode_batch(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[TokenizedText]:
        """Tokenize several texts (see ``encode``); HF tokenizers encode the batch natively.

        Args:
            texts: the texts.
            add_special_tokens: as in ``encode``.

        Returns:
            One TokenizedText per text, in order.

        Raises:
            ValueError: (UnicodeEncodeError) if a text is not valid Unicode for UTF-8.
        """
        texts = list(texts)
        all_bytes = [t.encode("utf-8") for t in texts]
        raw = self._raw_encode_batch(texts, add_special_tokens)
        return [self._finish_encode(t, b, *r) for t, b, r in zip(texts, all_bytes, raw)]

    def _raw_encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[tuple]:
        """Batch version of ``_raw_encode`` (override where the backend batches natively)."""
        return [self._raw_encode(t, add_special_tokens) for t in texts]

    def _finish_encode(
        self,
        text: str,
        text_bytes: bytes,
        ids_N: np.ndarray,
        offsets_N2,
        offsets_are_chars: bool,
    ) -> TokenizedText:
        roles_N = self._roles[ids_N] if len(ids_N) else np.zeros(0, dtype=np.int8)
        spans_N2 = compute_byte_spans(
            text,
            text_bytes,
            ids_N,
            offsets_N2,
            offsets_are_chars=offsets_are_chars,
            token_bytes=self._token_bytes,
            token_len=self._token_len,
            is_content_N=roles_N == ROLE_CONTENT,
            dummy_prefix=self._dummy_prefix,
            packed=self._packed,
        )
        return TokenizedText(ids_N, spans_N2, roles_N.astype(np.int8), text)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for as a piece of text.

        Byte-level BPE: the GPT-2 byte alphabet mapped back to raw bytes (a token can be part of a
        UTF-8 character). SentencePiece: ``▁`` -> space, ``<0xHH>`` -> that byte. Special and
        control tokens: b"".

        Args:
            token_id: 0 <= token_id < vocab_size.

        Returns:
            The bytes.

        Raises:
            ValueError: if the id is out of range.
        """
        self._check_id(token_id)
        return self._token_bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for special/control tokens (BOS, EOS, pad, chat markers, unused ids...)."""
        self._check_id(token_id)
        return bool(self._roles[token_id] != ROLE_CONTENT)

    def special_role(self, token_id: int) -> str | None:
        """The role of a token: "bos", "eos", "pad", "special" or None for content tokens."""
        self._check_id(token_id)
        return ROLE_NAMES.get(int(self._roles[token_id]))

    @property
    def roles_table(self) -> np.ndarray:
        """int8 [vocab_size] role code of every id (read-only view)."""
        view = self._roles.view()
        view.flags.writeable = False
        return view

    def _check_id(self, token_id: int) -> None:
        if not 0 <= int(token_id) < self.vocab_size:
            raise ValueError(
                f"token id {token_id} is out of range for tokenizer {self.name!r} "
                f"(vocab_size={self.vocab_size}); pass an id in [0, {self.vocab_size})"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"
