"""Rollout worker logic: a copy of the student samples continuations of prompts, and each prompt
with its continuation becomes an on-policy sample, made exactly as a collator makes one of text.

``RolloutWorker`` knows nothing of sockets: the process shell (main.py) takes its prompts
(prompts.py), calls :meth:`RolloutWorker.refresh` between batches (the trainer's newest
published weights, ``xtoken_core.ipc.policy_weights``) and :meth:`RolloutWorker.rollout` per
batch, and puts what it returns.

A batch: the prompts are left-padded and sampled together (Hugging Face ``generate``: KV cache,
temperature, top-p, ``max_new_tokens``); a continuation ends at the student's EOS (which is not
kept: no text is behind it). The student ids of prompt + continuation go through
``CrossTokenizerCollator.collate_sampled``'s steps: the text they spell (cut before the first
token whose bytes are no valid UTF-8), the teacher tokenization of that text, the alignment. Each
sample also carries :data:`services.protocol.rollout.ROLLOUT_FIELDS`: the weights' version, the
prompt's length, and which teacher tokens (and bytes) belong to the continuation.

GPU memory: ``generate`` grows its KV cache by one token per step (a new, slightly larger tensor
each time), which leaves the caching allocator's fixed-size blocks unusable for the next request:
on an H100 a batch of 64 prompts x (128 + 384) tokens of the Qwen3-0.6B preset peaked at 4.8 GiB
allocated but held 35.8 GiB, starving the trainer that shares the GPU. The worker therefore uses
expandable segments (one segment that grows, :func:`use_expandable_segments`; not when the user
set ``PYTORCH_ALLOC_CONF``) and hands its free cache back after every batch.

With ``kv_cache: static`` every batch has one shape, ``batch`` x ``prompt_tokens`` (a short
batch filled with copies of its last prompt, whose rows are dropped): transformers compiles the
decoding step for the first batch and reuses it for every later one, where a new shape would
compile it again.

Legend: B prompts of a batch, L the longest prompt, N new tokens.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from services.protocol.rollout import ROLLOUT_FIELDS, rollout_values
from services.rollout.config import RolloutConfig
from services.rollout.prompts import Prompt
from xtoken_core.data import sample as schema
from xtoken_core.data_plane.codec import samples_to_columns
from xtoken_core.tokenizers.base import TokenizedText

logger = logging.getLogger(__name__)

# the allocator's settings, by their current and their older name
ALLOCATOR_ENVS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def use_expandable_segments(environ: dict[str, str] | None = None) -> bool:
    """Make this process's CUDA caching allocator grow one segment instead of caching blocks of
    every size (unless ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` is set: the user's
    settings stand).

    Returns:
        True when the setting was made.
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in ALLOCATOR_ENVS):
        return False
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")  # no public setter
    return True


def continuation_bounds(
    student: TokenizedText, teacher: TokenizedText, prompt_length: int
) -> tuple[int, int]:
    """Which teacher tokens are the continuation's: ``(first, bytes)``.

    Args:
        student: the sample's student tokens (prompt first).
        teacher: its teacher tokens.
        prompt_length: student tokens of the prompt.

    Returns:
        ``first``: the teacher tokens before it lie wholly in the prompt's bytes (at least 1:
        the first token has no prediction); ``bytes``: the bytes the teacher tokens from
        ``first`` on cover (0 when there are none).
    """
    kept = min(prompt_length, len(student))
    prompt_end = int(student.spans[kept - 1, 1]) if kept else 0
    ends = teacher.spans[:, 1]
    first = max(1, int((ends <= prompt_end).sum()))
    if first >= len(teacher):
        return first, 0
    return first, int(ends.max()) - int(teacher.spans[first, 0])


def samples_to_fields(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """The fields of one put of on-policy samples: every field of a collated sample, then the
    :data:`ROLLOUT_FIELDS`, in that order (the put's layout never depends on what else a sample
    holds).

    Args:
        samples: N >= 1 samples of :meth:`RolloutWorker.make_samples`.

    Returns:
        field name -> ``[N]`` tensor (per-sample fields) or ``JaggedColumn`` of N rows.

    Raises:
        ValueError: no samples, or a sample misses a field (names it).
    """
    names = (*schema.FIELD_NAMES, *ROLLOUT_FIELDS)
    try:
        return samples_to_columns([{name: s[name] for name in names} for s in samples])
    except KeyError as e:
        raise ValueError(f"an on-policy sample misses field {e.args[0]!r}") from None


def stopping_criteria(stop: Callable[[], bool] | None) -> Any:
    """The stopping criteria of ``generate`` that end a generation once ``stop()`` is True.

    Args:
        stop: polled between tokens; None never stops early.

    Returns:
        A ``transformers.StoppingCriteriaList``. Its flags lie on the device of the ``input_ids``
        it is called with, as ``generate`` ORs them with its own there.
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):  # noqa: ANN001 (transformers API)
            done = bool(stop and stop())
            return torch.full(
                (input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device
            )

    return StoppingCriteriaList([_Stop()])


class RolloutWorker:
    """The student's copy, the tokenizers and the collator of one rollout worker.

    Args:
        config: the worker settings.
        model: an already built student (tests); default ``load_model(config.student)``.

    Raises:
        ValueError: unknown tokenizers or model (names them).
    """

    def __init__(self, config: RolloutConfig, model: torch.nn.Module | None = None) -> None:
        from xtoken_core.align import TokenAligner
        from xtoken_core.data.collator import CrossTokenizerCollator, resolve_pad_id
        from xtoken_core.ipc.policy_weights import WeightSubscriber
        from xtoken_core.models import load_model
        from xtoken_core.models.dtypes import resolve_dtype
        from xtoken_core.models.loading import student_vocab_size
        from xtoken_core.models.vocab import model_vocab_size
        from xtoken_core.tokenizers import load_tokenizer

        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            use_expandable_segments()
        student_tok = load_tokenizer(config.student_tokenizer)
        self.collator = CrossTokenizerCollator(
            student_tokenizer=student_tok,
            teacher_tokenizer=load_tokenizer(config.teacher_tokenizer),
            aligner=TokenAligner(),
            ctx_length_student=config.ctx_student,
            ctx_length_teacher=config.ctx_teacher,
            kd_where_agrees=(
                load_tokenizer(config.kd_where_agrees) if config.kd_where_agrees else None
            ),
        )
        self.tokenizer = student_tok
        self.pad_id = resolve_pad_id(student_tok)
        self.eos_id = student_tok.eos_id
        if model is None:
            model = load_model(
                config.student,
                vocab_size=config.vocab_size
                or student_vocab_size(config.student, student_tok.vocab_size),
                dtype=resolve_dtype(config.dtype, str(self.device)),
                device=self.device,
                seed=config.seed,
            )
        self.model = model.to(self.device).eval().requires_grad_(False)
        # a model's output layer may be wider than its tokenizer (Qwen3: 151,936 logits, 151,669
        # ids): the ids past the tokenizer have no text, so they are never sampled
        self.beyond_vocab = list(range(student_tok.vocab_size, model_vocab_size(self.model)))
        self.weights = WeightSubscriber(config.weights)
        self.version: int | None = None  # of the weights in the model; None: none yet

    def refresh(self) -> int | None:
        """Take the trainer's newest published weights, if newer than the model's (call it
        between batches).

        Returns:
            The version taken, or None when nothing newer is published.

        Raises:
            SettingsError: the published weights are of another model (the rollout's student
                is not the trainer's). A damaged publication is no error: nothing newer yet.
        """
        version = self.weights.load_into(self.model)
        if version is not None:
            if self.version is not None:
                logger.debug("[rollout] weights %d -> %d", self.version, version)
            self.version = version
        return version

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        seed: int,
        stop: Callable[[], bool] | None = None,
    ) -> list[list[int]]:
        """Sample a continuation of each prompt (one batched ``generate``).

        Args:
            prompts: B prompts (student ids, each at least one).
            seed: the seed of this batch's sampling.
            stop: polled between tokens; True ends the generation early (a stopping process).

        Returns:
            B rows: the prompt's ids, then the sampled ids up to (not including) the first EOS.
        """
        cfg = self.config
        given = len(prompts)
        B, L = given, max(len(p) for p in prompts)
        if cfg.kv_cache == "static":
            # one shape for every batch, so the compiled decoding step is never compiled again:
            # a short batch is filled with copies of its last prompt (their rows are dropped),
            # prompts are left-padded to prompt_tokens
            prompts = [*prompts, *[prompts[-1]] * (cfg.batch - given)]
            B, L = len(prompts), max(L, cfg.prompt_tokens)
        ids_BL = torch.full((B, L), self.pad_id, dtype=torch.int64)
        mask_BL = torch.zeros((B, L), dtype=torch.int64)
        for b, p in enumerate(prompts):  # left padding: every row's next token is at column L
            ids_BL[b, L - len(p) :] = torch.as_tensor(list(p), dtype=torch.int64)
            mask_BL[b, L - len(p) :] = 1

        torch.manual_seed(seed)
        greedy = cfg.temperature == 0
        with torch.inference_mode():
            out_BT = self.model.generate(
                input_ids=ids_BL.to(self.device),
                attention_mask=mask_BL.to(self.device),
                max_new_tokens=cfg.max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else cfg.temperature,
                top_p=None if greedy else cfg.top_p,
                top_k=None,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                use_cache=True,
                **({"cache_implementation": "static"} if cfg.kv_cache == "static" else {}),
                suppress_tokens=self.beyond_vocab or None,
                stopping_criteria=stopping_criteria(stop),
            ).cpu()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what the batch's KV cache held goes back to the trainer
        rows = []
        for b, p in enumerate(prompts[:given]):
            new = out_BT[b, L:].tolist()
            if self.eos_id is not None and self.eos_id in new:
                new = new[: new.index(self.eos_id)]
            rows.append(list(p) + new)
        return rows

    def make_samples(
        self, rows: Sequence[Sequence[int]], prompt_lengths: Sequence[int], version: int
    ) -> list[dict[str, torch.Tensor]]:
        """On-policy samples of sampled rows (see the module docstring).

        Args:
            rows: B rows of student ids (prompt and continuation).
            prompt_lengths: B prompt lengths.
            version: the version of the weights that sampled them.

        Returns:
            B sample dicts: the collator's fields and :data:`ROLLOUT_FIELDS`.
        """
        students, teachers = self.collator.tokenize_sampled(rows)
        out = []
        for s, t, n in zip(students, teachers, prompt_lengths, strict=True):
            sample = self.collator.pack_sample(s, t)
            first, scored = continuation_bounds(s, t, n)
            sample.update(
                rollout_values(
                    policy_version=version,
                    prompt_length=min(n, len(s)),
                    teacher_prompt_length=first,
                    scored_bytes=scored,
                )
            )
            out.append(sample)
        return out

    def rollout(
        self, prompts: Sequence[Prompt], stop: Callable[[], bool] | None = None
    ) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
        """Sample a batch and make its samples (nothing is sent).

        Args:
            prompts: the batch's prompts.
            stop: as :meth:`sample`.

        Returns:
            ``(keys, fields, counts)``: the keys and fields of one put, and ``{"samples",
            "generated_tokens", "sample_s", "collate_s", "version"}``.

        Raises:
            ValueError: no weights were taken yet (:meth:`refresh` first).
        """
        if self.version is None:
            raise ValueError("no trainer weights loaded yet: call refresh() until it returns one")
        version = self.version
        start = time.perf_counter()
        rows = self.sample([p.ids for p in prompts], seed=self._seed(prompts[0]), stop=stop)
        sampled = time.perf_counter()
        samples = self.make_samples(rows, [len(p.ids) for p in prompts], version)
        fields = samples_to_fields(samples)
        counts = {
            "samples": len(samples),
            "generated_tokens": sum(len(r) - len(p.ids) for r, p in zip(rows, prompts)),
            "sample_s": sampled - start,
            "collate_s": time.perf_counter() - sampled,
            "version": version,
        }
        return [p.key for p in prompts], fields, counts

    def _seed(self, first: Prompt) -> int:
        """The sampling seed of a batch: the run's seed and the position of its first prompt."""
        pass_index, index = first.position
        return (self.config.seed * 1_000_003 + pass_index * 7_919 + index) % (1 << 63)
