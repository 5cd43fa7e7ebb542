"""kv_serve's import face: lazy public names, optional extras, and no BLAS loaded on import.

The import checks run in a fresh interpreter: the test session itself has imported mlx and
loaded its BLAS long before.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

import kv_serve
from kv_serve._extras import EXTRA_MODULES, MissingExtraError, require_extra

README = Path(__file__).resolve().parent.parent / "README.md"

#: The public names, as the README's API section documents them.
DOCUMENTED = [
    "BLAS_ENV",
    "JIT_FLAGS_ENV",
    "CpuJitInfo",
    "active_cpu_jit",
    "configure_cpu_jit",
    "CHAT_TEMPLATES",
    "DEFAULT_KV_SLAB_BYTES",
    "DRAFT_SPECULATIVE_TOKENS",
    "NGRAM_SPECULATIVE_TOKENS",
    "GEMMA3_270M",
    "GEMMA3_CHAT_TEMPLATE",
    "GEMMA3_HARD_CODED",
    "RANK_LOST_EXIT",
    "BlasError",
    "BlasInfo",
    "ChatTemplate",
    "Completion",
    "DraftModelProposer",
    "EngineDraftProposer",
    "GenerationStats",
    "KVServer",
    "LockstepEngine",
    "PoolConfig",
    "RankGroup",
    "RankLostError",
    "RunningServer",
    "ServerConfig",
    "ServerMetrics",
    "TextStream",
    "active_blas",
    "build_engine",
    "build_kernels",
    "build_pool",
    "cli_main",
    "complete",
    "convert_gguf",
    "default_cache_dir",
    "draft_speculation",
    "encode_prompt",
    "generate",
    "gguf_sha256",
    "init_ranks",
    "load_fast_blas",
    "load_model",
    "pool_backed_cache",
    "read_gguf_tensor",
    "shard_model",
    "stop_token_ids",
]

#: Modules that only the optional extras bring; a plain import must load none of them.
HEAVY = ("fastapi", "starlette", "uvicorn", "gguf", "transformers")
#: Shared libraries of a BLAS: MLX's own reference one, OpenBLAS or MKL.
BLAS_LIBRARY = re.compile(r"lib(blas|lapack|openblas\w*|mkl\w*)[-.]")


def _mkl_installed() -> bool:
    try:
        metadata.version("mkl")
    except metadata.PackageNotFoundError:
        return False
    return True


_PROBE = """
    import json, re, sys

    BLAS = re.compile(sys.argv[1])
    HEAVY = sys.argv[2].split(",")

    def state():
        maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
        libraries = sorted({line.split()[-1] for line in maps.splitlines() if ".so" in line})
        return {
            "modules": sorted(m for m in HEAVY + ["mlx", "mlx_lm"] if m in sys.modules),
            "blas": [path for path in libraries if BLAS.search(path.rsplit("/", 1)[-1])],
        }

    out = {}
    import kv_serve
    out["import"] = state()
    from kv_serve import build_engine
    out["build_engine"] = state()
    print(json.dumps(out))
"""

_LOAD = """
    import json
    import kv_serve

    before = open("/proc/self/maps").read()
    info = kv_serve.load_fast_blas()
    after = open("/proc/self/maps").read()
    print(json.dumps({"name": info.name, "before": info.path in before,
                      "after": info.path in after, "active": kv_serve.active_blas() == info}))
"""


def _run(code: str, *args: str) -> dict[str, object]:
    environment = {k: v for k, v in os.environ.items() if k != "KV_SERVE_BLAS"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_all_is_exactly_the_documented_list() -> None:
    assert sorted(kv_serve.__all__) == sorted(DOCUMENTED)
    assert len(set(kv_serve.__all__)) == len(kv_serve.__all__)
    api = README.read_text().split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    for name in DOCUMENTED:
        assert f"`{name}" in api, f"{name} is not in the README's API section"
        assert name in dir(kv_serve)
        value = getattr(kv_serve, name)
        if callable(value):
            assert value.__doc__, name


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'kv_serve' has no attribute 'build_engin'"):
        kv_serve.build_engin  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'nothing' from 'kv_serve'"):
        exec("from kv_serve import nothing")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_import_loads_no_http_stack_no_gguf_and_no_blas() -> None:
    found = _run(_PROBE, BLAS_LIBRARY.pattern, ",".join(HEAVY))
    # ``import kv_serve`` imports neither mlx nor any extra, and maps no BLAS at all.
    assert found["import"] == {"modules": [], "blas": []}
    # ``build_engine`` brings mlx (with the reference BLAS its wheel links, if any), never
    # a fast one, and none of the extras' modules.
    after = found["build_engine"]
    assert isinstance(after, dict)
    assert "mlx" in after["modules"]
    assert not set(after["modules"]) & set(HEAVY), after["modules"]
    assert not [path for path in after["blas"] if "mkl" in path or "openblas" in path], after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS loader acts on Linux")
@pytest.mark.skipif(not _mkl_installed(), reason="the mkl package (fast-cpu extra) is absent")
def test_load_fast_blas_maps_one_into_the_process() -> None:
    found = _run(_LOAD)
    assert found["name"] in ("mkl", "openblas"), found
    assert (found["before"], found["after"], found["active"]) == (False, True, True), found


def test_a_missing_extra_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec

    def without_uvicorn(name: str, package: str | None = None) -> object:
        return None if name == "uvicorn" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_uvicorn)
    for name in ("KVServer", "RunningServer"):
        monkeypatch.delitem(vars(kv_serve), name, raising=False)
    with pytest.raises(MissingExtraError) as raised:
        kv_serve.KVServer  # noqa: B018
    message = str(raised.value)
    assert "pip install 'kv-serve[server]'" in message and "uvicorn not installed" in message
    assert isinstance(raised.value, ImportError) and raised.value.name == "uvicorn"
    with pytest.raises(ImportError, match=re.escape("pip install 'kv-serve[server]'")):
        exec("from kv_serve import RunningServer")


def test_gguf_parts_need_the_gguf_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    monkeypatch.delitem(vars(kv_serve), "convert_gguf", raising=False)
    with pytest.raises(ImportError, match=re.escape("pip install 'kv-serve[gguf]'")):
        kv_serve.convert_gguf  # noqa: B018
    # An mlx-lm directory needs no extra; a .gguf file is refused by the command line with
    # one line that names the extra.
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    status = kv_serve.cli_main(
        ["generate", "--model", str(model), "--prompt", "x", "--cache-dir", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert err.splitlines() == [
        "error: loading GGUF files needs kv-serve's 'gguf' extra (gguf not installed): "
        "pip install 'kv-serve[gguf]'"
    ]


def test_every_extra_module_is_installed_here() -> None:
    # This workspace installs kv-serve with every extra, so nothing above passed by luck.
    for extra in EXTRA_MODULES:
        require_extra(extra)
