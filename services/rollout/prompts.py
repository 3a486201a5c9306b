"""The prompts of one rollout worker: read from a corpus in order, pass after pass, resumable.

Position ``(pass, index)``: ``index`` counts the texts of the corpus in order (``limit`` of them)
and a pass is one read of them; worker ``w`` of ``W`` takes the texts whose index is ``w`` modulo
``W``, so the workers of a run share the prompts without talking. A prompt is the first
``prompt_tokens`` student tokens of a text (its specials included, so a BOS starts it where the
tokenizer adds one), or of its ``prompt_field``. A text with no content token gives none.

:class:`PromptState` keeps the position after the last prompt whose sample was put, in a small
JSON file written atomically: a worker restarted after a crash begins there, so the prompts of
the batch it was sampling when it died come again (with the same keys) and the others do not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.protocol.rollout import rollout_key
from xtoken_core.errors import DataError
from xtoken_core.tokenizers import ROLE_CONTENT

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt.

    Attributes:
        key: the key of the sample it becomes (:func:`services.protocol.rollout.rollout_key`).
        position: ``(pass, index)`` of its text.
        ids: its student token ids.
    """

    key: str
    position: tuple[int, int]
    ids: list[int]


class PromptSource:
    """The prompts of worker ``worker`` of ``workers``, from ``start`` on, for ever.

    Args:
        corpus: the prompt corpus (a file, folder or glob: ``xtoken_core.data.corpus``).
        tokenizer: the student tokenizer.
        prompt_tokens: most tokens of a prompt.
        worker: this worker's index.
        workers: how many workers share the corpus.
        text_field: the field of the texts.
        prompt_field: the field of the prompts (None: the texts' first tokens).
        limit: use only the first ``limit`` texts.
        start: the position to begin at (:class:`PromptState`); None: the first text.
    """

    def __init__(
        self,
        corpus: str,
        tokenizer: Any,
        prompt_tokens: int,
        *,
        worker: int = 0,
        workers: int = 1,
        text_field: str = "text",
        prompt_field: str | None = None,
        limit: int | None = None,
        start: tuple[int, int] | None = None,
    ) -> None:
        from xtoken_core.data.corpus import corpus_files

        self.files = corpus_files(corpus)  # a missing corpus fails here, before any model loads
        self.corpus = corpus
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.worker = worker
        self.workers = workers
        self.field = prompt_field or text_field
        self.limit = limit
        self.start = start or (0, 0)

    def __iter__(self) -> Iterator[Prompt]:
        """Prompts in order from ``start``, pass after pass.

        Raises:
            DataError: a pass over the corpus gives this worker no prompt (names the corpus).
        """
        pass_index, skip = self.start
        while True:
            found = False
            for index, key, text in self._texts():
                if index < skip or index % self.workers != self.worker:
                    continue
                ids = self.tokenizer.encode(text).ids[: self.prompt_tokens]
                if not (self.tokenizer.roles_table[ids] == ROLE_CONTENT).any():
                    continue  # nothing to continue from
                found = True
                yield Prompt(rollout_key(pass_index, key), (pass_index, index), ids.tolist())
            if not found and skip == 0:
                raise DataError(
                    f"the prompt corpus {self.corpus} gives rollout worker {self.worker} of "
                    f"{self.workers} no prompt (no text with content tokens at its positions); "
                    "give a larger corpus or fewer rollout workers"
                )
            pass_index, skip = pass_index + 1, 0

    def _texts(self) -> Iterator[tuple[int, str, str]]:
        from xtoken_core.data.corpus import iter_texts

        index = 0
        for path in self.files:
            for key, text in iter_texts(path, text_field=self.field):
                if self.limit is not None and index >= self.limit:
                    return
                yield index, key, text
                index += 1


class PromptState:
    """The position after the last prompt put, kept in ``<directory>/worker<w>.json``.

    Args:
        directory: where the file goes (None: nothing is kept).
        worker: the worker's index.
    """

    def __init__(self, directory: str | os.PathLike | None, worker: int) -> None:
        self.path = None if directory is None else Path(directory) / f"worker{worker}.json"

    def load(self) -> tuple[int, int] | None:
        """The position to begin at, or None (nothing kept)."""
        if self.path is None or not self.path.is_file():
            return None
        try:
            d = json.loads(self.path.read_text())
            return int(d["pass"]), int(d["index"])
        except (ValueError, KeyError, TypeError):
            logger.warning("[rollout] %s is unreadable: starting from the first prompt", self.path)
            return None

    def save(self, after: tuple[int, int]) -> None:
        """Keep the position after ``after`` (the position of the last prompt put)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"pass": after[0], "index": after[1] + 1}))
        os.replace(tmp, self.path)
