"""The checks before any process of a run starts, and the inputs they settle: the corpora (readable,
with text), the tokenizers and the models' vocabularies, the devices and the layout, each teacher
cache of ``data.teacher_cache`` (services/cache/check.py: built for its teacher, holding every
sample), and each teacher's projection (services/supervise/projections.py: given and checked, or
built once into the cache)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.cache.check import check_teacher_caches
from services.supervise.config import RunConfig
from services.supervise.projections import (
    build_cached_projection,
    cache_dir,
    check_projection,
    projection_cache_path,
    settle_projections,
    slug,
)
from xtoken_core.errors import DataError, SettingsError

# What other modules import from here (the projections' names live in projections.py).
__all__ = [
    "Inputs",
    "build_cached_projection",
    "check_corpora",
    "check_devices",
    "check_projection",
    "check_run_layout",
    "check_train",
    "check_transport",
    "check_vocabs",
    "first_text",
    "preflight",
    "projection_cache_path",
    "slug",
    "spec_vocab_size",
    "split_heldout",
]

logger = logging.getLogger(__name__)

SMOLLM2_VOCAB = 49152


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the preflight settled for a run: the files its processes read.

    Attributes:
        train: the training corpus (the config's, or the demo corpus).
        heldout: the held-out corpus (the config's, or the demo's).
        projection: teacher 0's projection file (the config's, or the one built for the run);
            None when the loss needs none.
        train_limit: texts of ``train`` the collator reads (the config's ``data.limit``, or
            fewer when the held-out texts are the last ones of ``train``); None: all.
        extra_projections: the projection file of each further teacher (``extra_teachers``), as
            ``projection`` is teacher 0's.
    """

    train: str | None
    heldout: str | None
    projection: str | None
    train_limit: int | None = None
    extra_projections: tuple[str | None, ...] = ()

    @classmethod
    def given(cls, config: RunConfig) -> Inputs:
        """The inputs a config names itself (no file is read): a plan of a config that names all
        its inputs needs no preflight."""
        return cls(
            config.data.train,
            config.data.heldout,
            config.trainer.loss.projection,
            config.data.limit,
            tuple(e.projection for e in config.extra_teachers),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON mapping (a run's runtime record keeps it: a re-attached run plans the same
        sections as the launched one)."""
        out = dataclasses.asdict(self)
        out["extra_projections"] = list(self.extra_projections)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Inputs:
        """The inverse of :meth:`to_dict`."""
        return cls(
            data.get("train"),
            data.get("heldout"),
            data.get("projection"),
            data.get("train_limit"),
            tuple(data.get("extra_projections") or ()),
        )


def preflight(config: RunConfig) -> Inputs:
    """Check a run's inputs before any process starts; build its projection when it needs one
    and the config names none.

    Args:
        config: the run config (not modified).

    Returns:
        The run's :class:`Inputs`.

    Raises:
        ValueError: a CUDA device this machine lacks, ``mps: true`` without the MPS control
            program, a tracker (``trainer.observe.report_to``) whose
            package is not installed, a missing or unreadable corpus, an unknown
            tokenizer, a model whose vocab does not fit its tokenizer, a projection built for
            other tokenizers (each names the key and the fix).
    """
    from services.trainer.tracking import check_installed
    from xtoken_core.tokenizers import load_tokenizer

    check_devices(config)
    if config.mps:
        from services.supervise.mps import control_binary

        control_binary()  # installed, before anything starts
    check_installed(config.trainer.observe.report_to)  # a tracker's package, before anything starts
    check_corpora(config)
    train, heldout, train_limit = config.data.train, config.data.heldout, config.data.limit
    if train is None:
        from xtoken_core.data.corpus import build_demo_corpus

        demo = build_demo_corpus()
        train = str(demo.train_path)
        heldout = heldout or str(demo.heldout_path)
    if not config.trainer.eval.texts:  # no held-out eval: no split held out of data.train
        heldout = None
    elif heldout is None:
        heldout, train_limit = split_heldout(config, train)
    tokenizers = {}
    views = config.teacher_list()
    names = {
        "student_tokenizer": config.student_tokenizer,
        **{view.tokenizer_key: view.tokenizer for view in views},
        "kd_where_agrees": config.kd_where_agrees,
    }
    for key, name in names.items():
        try:
            tokenizers[key] = load_tokenizer(name) if name else None
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    s_tok = tokenizers["student_tokenizer"]
    t_toks = [tokenizers[view.tokenizer_key] for view in views]
    vocabs = [t.vocab_size for t in t_toks]
    check_vocabs(config, s_tok.vocab_size, vocabs[0], vocabs[1:])
    check_run_layout(config, s_tok.vocab_size, vocabs[0], vocabs[1:])
    check_transport(config, vocabs[0], vocabs[1:])
    # each teacher a cache serves: built for it, and holding every sample the collator reads
    check_teacher_caches(config, train, train_limit)
    projections = settle_projections(config, s_tok, t_toks)
    return Inputs(train, heldout, projections[0], train_limit, tuple(projections[1:]))


def check_corpora(config: RunConfig) -> None:
    """The corpora a config names are there and hold text: ``data.train``, the rollouts'
    ``rollout.prompts`` (with on-policy samples) and the held-out files. Only each first text
    is read and no model code is imported, so that ``xtoken run`` refuses a missing corpus at
    once, before it starts or loads anything.

    Raises:
        SettingsError: a held-out setting that names no file (names the key).
        DataError: a held-out corpus without text (names the key).
        ValueError: a training corpus that is missing, unreadable or without text.
    """
    data = config.data
    if data.train is not None:
        check_train(data.train, data.text_field, txt_split=data.txt_split)
    if config.on_policy and config.rollout.prompts is not None:
        check_train(config.rollout.prompts, config.rollout.text_field, "rollout.prompts")
    if data.heldout is not None:
        if not Path(data.heldout).is_file():
            raise SettingsError(
                f"data.heldout={data.heldout!r} is not a file; point it at a corpus file"
            )
        try:
            first_text(data.heldout, "text")
        except ValueError as e:
            raise DataError(f"data.heldout: {e}") from None


def check_train(
    train: str, text_field: str, key: str = "data.train", *, txt_split: str = "blank_line"
) -> None:
    """``data.train`` names what the collator reads (a corpus file, a folder of them or a glob)
    and its first file with text has some (``key``: the setting, e.g. ``rollout.prompts``;
    ``txt_split``: how a ``.txt`` file is cut into texts).

    Raises:
        ValueError: nothing there, no corpus file in a folder or glob, or no usable text.
    """
    from xtoken_core.data.corpus import corpus_files

    try:
        files = corpus_files(train)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(
            f"{key}={train!r} is not a file, a folder or a glob of corpus files ({e}); "
            "point it at a corpus"
        ) from None
    try:
        first_text(str(files[0]), text_field, txt_split)
    except ValueError as e:
        field_key = f"{key.rpartition('.')[0]}.text_field"
        raise ValueError(f"{key}: {_as_setting(e, field_key)}") from None


def _as_setting(error: Exception, key: str) -> str:
    """A corpus reader's message with the library's argument (``pass text_field=``) as the run
    config's setting ``key`` (a user sets ``data.text_field``, not an argument)."""
    return str(error).replace("pass text_field=", f"set {key}")


def split_heldout(config: RunConfig, train: str) -> tuple[str, int]:
    """Hold out the last ``trainer.eval.texts`` texts of ``data.train`` (a run that names no
    ``data.heldout``): they are written to a file of the cache, and the collator reads only the
    texts before them. Announced in the output.

    Returns:
        The held-out file and the texts of ``train`` the collator reads.

    Raises:
        ValueError: ``train`` has too few texts to hold any out, or a bad line (names file:line
            and ``data.skip_bad_lines``).
    """
    import collections
    import hashlib
    import json

    from xtoken_core.data.corpus import BadCorpusLine, corpus_files, iter_texts

    n = config.trainer.eval.texts
    data = config.data
    files = corpus_files(train)
    on_bad = (lambda err: None) if data.skip_bad_lines else None
    tail: collections.deque[str] = collections.deque(maxlen=n)
    total = 0
    digest = hashlib.sha256(f"{n}\0{data.text_field}\0{data.txt_split}".encode())
    try:
        for path in files:
            st = path.stat()
            digest.update(f"\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
            texts = iter_texts(
                path, text_field=data.text_field, txt_split=data.txt_split, on_bad=on_bad
            )
            for _, text in texts:
                total += 1
                tail.append(text)
    except BadCorpusLine as e:
        raise ValueError(
            f"data.train: {_as_setting(e, 'data.text_field')}; fix the line, or set "
            "data.skip_bad_lines: true to skip bad lines"
        ) from None
    if total <= n:
        raise ValueError(
            f"data.train={train!r} has {total} texts: too few to hold out the last "
            f"trainer.eval.texts={n} and train on the rest; name a data.heldout corpus"
        )
    out = cache_dir() / "heldout" / f"{slug(train)}_{digest.hexdigest()[:16]}.jsonl"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            for text in tail:
                f.write(json.dumps({"text": text}) + "\n")
        os.replace(tmp, out)
    keep = total - n if data.limit is None else min(data.limit, total - n)
    logger.info(
        "[run] held-out: the last %d texts of %s (data.train; name data.heldout to choose "
        "another corpus); training on the %d before them",
        n,
        train,
        keep,
    )
    return str(out), keep


def check_devices(config: RunConfig) -> None:
    """A CUDA device the config asks for (``trainer.compute.device``, ``teacher.device`` when the
    loss uses a teacher, ``rollout.device`` with on-policy samples) is on this machine.

    Raises:
        ValueError: ``cuda`` without CUDA, or ``cuda:N`` past the GPUs there (names the key).
    """
    wanted = [(key, value) for key, value in config.devices() if value.startswith("cuda")]
    if not wanted:
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for key, value in wanted:
        index = value.partition(":")[2]
        if gpus == 0:
            raise ValueError(
                f"{key}={value!r} but this machine has no CUDA device: set {key}: cpu, or run "
                "on a machine with a GPU"
            )
        if index and (not index.isdigit() or int(index) >= gpus):
            raise ValueError(
                f"{key}={value!r} but this machine has {gpus} CUDA device(s): use cuda (the "
                f"first free one), cuda:0..cuda:{gpus - 1}, or cpu"
            )


def check_transport(
    config: RunConfig, teacher_vocab: int, extra_vocabs: Sequence[int] = ()
) -> None:
    """Say each teacher's transport where the run places it apart from the trainers, refuse a
    ``top_k`` its vocab cannot serve, and say what ``topk`` targets cost the loss: P-KL's column
    pick (``trainer.loss.vocab_topk`` columns by the largest teacher logit) sees the K sent ids
    and an equal value for every other one, and its gradient moves far more than over every
    column (benchmarks/results/teachers_topk.md: 38% against 1.8% at K = 64); one warning line
    names the setting.

    Args:
        config: the run config.
        teacher_vocab: teacher 0's tokenizer vocab.
        extra_vocabs: each further teacher's tokenizer vocab.

    Raises:
        ValueError: a teacher with ``topk`` targets whose ``top_k`` is larger than its model's
            vocab (names the key).
    """
    from services.supervise.layout import run_transport
    from xtoken_core.wire.topk import check_top_k

    loss = config.trainer.loss
    for view, tok_vocab in zip(config.teacher_list(), (teacher_vocab, *extra_vocabs), strict=False):
        t, key = view.section, view.key
        transport = run_transport(config, t)
        if config.apart(t):
            logger.info(
                "[run] the groups of %s are placed apart from the trainer ranks (%s.resources "
                "differ from trainer.resources): transport %s",
                key,
                key,
                transport,
            )
        if transport != "topk" or not loss.uses_teacher:
            continue
        vocab = t.vocab_size or tok_vocab
        try:
            vocab = spec_vocab_size(str(t.model), vocab)
        except ValueError:
            pass  # check_vocabs names a model it cannot read
        check_top_k(t.top_k, vocab, f"{key}.top_k")
        if (
            loss.mode == "pkl"
            and loss.vocab_topk is not None
            and loss.vocab_topk < vocab
            and t.top_k < vocab
        ):
            logger.warning(
                "[run] %s.transport topk (top_k=%d) with P-KL over trainer.loss.vocab_topk=%d "
                "columns: the column pick sees only the sent ids, which moves the loss's "
                "gradient (38%% at K = 64 against 1.8%% over every column); set "
                "trainer.loss.vocab_topk: null",
                key,
                t.top_k,
                loss.vocab_topk,
            )


def check_run_layout(
    config: RunConfig, student_vocab: int, teacher_vocab: int, extra_vocabs: Sequence[int] = ()
) -> None:
    """The trainer ranks' and every teacher's groups' GPUs are there, a tensor-parallel teacher
    divides its heads, and on GPUs each one's share of the models fits, the teachers on one GPU
    added up (services/supervise/layout.py).

    Args:
        config: the run config.
        student_vocab: the student tokenizer's vocab.
        teacher_vocab: teacher 0's tokenizer vocab.
        extra_vocabs: each further teacher's tokenizer vocab.

    Raises:
        SettingsError: one line naming the key and what would fit.
    """
    from services.supervise.layout import (
        check_layout,
        gpu_memory,
        model_config,
        parameter_count,
        plan_layout,
    )

    tr = config.trainer
    views = config.teacher_list()
    cuda = any(device.startswith("cuda") for _, device in config.devices())
    named = tr.gpus is not None or any(
        v.section.gpus is not None or v.section.tensor_parallel > 1 for v in views
    )
    if not (cuda or named):
        return
    import torch

    from xtoken_core.models.loading import student_vocab_size

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    layout = plan_layout(config, gpus)
    shapes: list[Any] = [None] * len(views)
    if tr.loss.uses_teacher:
        for i, (view, vocab) in enumerate(zip(views, (teacher_vocab, *extra_vocabs), strict=False)):
            shapes[i] = model_config(str(view.section.model), view.section.vocab_size or vocab)
    memory = gpu_memory() if cuda else None
    params: list[int | None] = [None] * len(views)
    student_params = None
    if memory is not None:
        for i, shape in enumerate(shapes):
            if shape is not None and layout.teacher(i):
                params[i] = parameter_count(shape)
        student_cfg = model_config(
            tr.student.model,
            tr.student.vocab_size or student_vocab_size(tr.student.model, student_vocab),
        )
        if student_cfg is not None and layout.trainer_gpus:
            student_params = parameter_count(student_cfg)
    check_layout(
        config,
        layout,
        gpus,
        memory,
        teacher_params=params[0],
        teacher_model_config=shapes[0],
        student_params=student_params,
        extra_teacher_params=params[1:],
        extra_teacher_model_configs=shapes[1:],
    )
    if layout.trainer_gpus or layout.groups():
        logger.info("[run] layout: %s", layout.describe())


def check_vocabs(
    config: RunConfig, student_vocab: int, teacher_vocab: int, extra_vocabs: Sequence[int] = ()
) -> None:
    """The student (and, when the loss uses them, every teacher) has a logit per token id of
    its tokenizer.

    Args:
        config: the run config.
        student_vocab: the student tokenizer's vocab.
        teacher_vocab: teacher 0's tokenizer vocab.
        extra_vocabs: each further teacher's tokenizer vocab.

    Raises:
        ValueError: a model spec that cannot be read, or whose vocab does not fit (names the key).
    """
    from xtoken_core.models import check_vocab

    cfg = config
    models = [
        (
            "trainer.student.model",
            cfg.trainer.student.model,
            cfg.trainer.student.vocab_size,
            student_vocab,
        )
    ]
    if cfg.trainer.loss.uses_teacher:
        for view, vocab in zip(cfg.teacher_list(), (teacher_vocab, *extra_vocabs), strict=False):
            t = view.section
            models.append((f"{view.key}.model", str(t.model), t.vocab_size, vocab))
    for key, spec, override, tok_vocab in models:
        try:
            model_vocab = spec_vocab_size(spec, override or tok_vocab)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        check_vocab(f"{key}={spec!r}", model_vocab, tok_vocab)


def spec_vocab_size(spec: str, preset_vocab: int) -> int:
    """The vocab of a model spec without loading its weights.

    Args:
        spec: a local HF directory, ``smollm2``, a preset name, a GGUF preset or ``gguf:PATH``,
            optionally with ``:drop=A-B`` (which keeps the vocab).
        preset_vocab: the vocab a preset is built with.

    Raises:
        ValueError: a directory that is not a causal LM (no ``config.json``, no safetensors
            weights, another model type) or has no ``vocab_size``; a GGUF preset whose part
            packages are missing (one line with the pip command) or whose joined file has
            another SHA-256 than the pinned one; a ``gguf:`` file that does not exist; an
            unknown spec.
    """
    from xtoken_core.models import GGUF_PRESETS, PRESETS, check_model_dir, model_spec_names
    from xtoken_core.models.gguf import GGUF_PREFIX, gguf_vocab_size
    from xtoken_core.models.layer_drop import split_spec

    spec, _ = split_spec(spec)
    path = Path(spec)
    if spec.startswith(GGUF_PREFIX):
        return gguf_vocab_size(spec[len(GGUF_PREFIX) :])
    if path.is_dir():
        config = check_model_dir(path)
        vocab = getattr(config, "vocab_size", None)
        if vocab is None and hasattr(config, "get_text_config"):
            vocab = getattr(config.get_text_config(), "vocab_size", None)
        if not isinstance(vocab, int):
            raise ValueError(f"model directory {spec!r}: config.json has no vocab_size")
        return vocab
    if spec == "smollm2":
        return SMOLLM2_VOCAB
    if spec in PRESETS:
        return preset_vocab
    if spec in GGUF_PRESETS:
        from xtoken_core.tokenizers.gguf_parts import assembled_gguf

        # joined and checked once (cached): missing packages or a bad part fail the run here
        try:
            assembled_gguf(GGUF_PRESETS[spec].split)
        except ValueError as e:
            raise ValueError(f"model {e}") from None
        return GGUF_PRESETS[spec].vocab_size
    raise ValueError(
        f"model {spec!r} is neither a local directory, gguf:PATH, nor one of "
        f"{', '.join(model_spec_names())}"
    )


def first_text(path: str, text_field: str, txt_split: str = "blank_line") -> str:
    """The first non-blank text of a corpus file (``txt_split``: how a ``.txt`` file is cut).

    Raises:
        ValueError: the file has no such text or cannot be read as a corpus (names the file).
    """
    from xtoken_core.data.corpus import iter_texts

    for _, text in iter_texts(path, text_field=text_field, txt_split=txt_split):
        if text.strip():
            return text
    raise ValueError(f"corpus {path!r} has no usable text; point it at a corpus with text")
