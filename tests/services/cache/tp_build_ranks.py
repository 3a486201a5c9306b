"""The ranks of the tensor-parallel cache builds that the tests spawn (an importable module: the
spawned processes unpickle these functions by name)."""

from __future__ import annotations

import json
from pathlib import Path


def build_with_group(rank: int, size: int, config: str, out: str, flags: dict) -> None:
    """Every rank runs ``xtoken cache build``'s builder of the run config ``config`` (whose
    teacher says ``tensor_parallel: size``) into ``out``; rank 0 saves its summary beside the
    cache (``summary.json``), the others save that they returned none."""
    from services.cache.build import BuildOptions, build_cache
    from services.supervise.config import load_run_config
    from xtoken_core.cache.format import Codec

    options = BuildOptions(out=out, codec=Codec(logprobs="fp32"), progress=False, **flags)
    summary = build_cache(load_run_config(config), options)
    saved = {"rank": rank, "summary": None}
    if summary is not None:
        saved["summary"] = {"written": summary.written, "complete": summary.complete}
    Path(out).with_name(f"{Path(out).name}.rank{rank}.json").write_text(json.dumps(saved))
