"""Dispatch v5 (`kernels/triton_dispatch_v5.py`, Gluon + PTX shared memory).

Gluon kernels do not run in Triton's interpreter, so on CPU these tests compile both
kernels for sm_90 (Triton runs ptxas locally) over the configurations the GPU check
uses, and check the assumption the PTX accesses rest on: the kernel's shared memory is
exactly the reserved buffers, laid out largest first from offset 0 (`check_layout`;
shown able to fail). The bits are compared with the reference on a GPU
(`benchmarks/dispatch_v5.py`, which exits 1 on any mismatch; and the GPU-only test
below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (transpose test)

import pytest  # noqa: E402
import torch  # noqa: E402

from freescale.kernels.common import triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _v5():
    from freescale.kernels import triton_dispatch_v5

    return triton_dispatch_v5


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return bool(get_ptxas(90).path)
    except Exception:  # noqa: BLE001 - any failure means: cannot compile for CUDA here
        return False


needs_ptxas = pytest.mark.skipif(
    not _ptxas_available(), reason="Triton's bundled ptxas is missing: cannot compile for sm_90"
)


def test_buffer_words_cover_the_size_in_descending_powers_of_two() -> None:
    v5 = _v5()
    for total in (1, 500, 4096, 90128, 107000, 181000, 227 * 1024):
        for unit in (32, 128, 512):
            parts = [p for p in v5.buffer_words(total, unit) if p]
            assert 1 <= len(parts) <= 4
            assert sum(parts) * 4 >= total
            assert all(p & (p - 1) == 0 and p >= unit for p in parts)
            assert parts == sorted(set(parts), reverse=True)  # distinct, largest first
            assert sum(parts) * 4 < total + 4 * max(unit, parts[0] // 8) + 4 * unit


def test_config_errors_are_clear() -> None:
    v5 = _v5()
    vals = torch.zeros(4, dtype=torch.int64)
    lengths = torch.tensor([2, 2])
    blocks = torch.tensor([10])
    with pytest.raises(ValueError, match="tile must be a power of two"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(tile=3000))
    with pytest.raises(ValueError, match="scatter_warps"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(scatter_warps=3))
    with pytest.raises(ValueError, match="unroll"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(unroll=3))
    with pytest.raises(ValueError, match="scatter must be one of"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(scatter="sorted"))
    with pytest.raises(ValueError, match="counts must be one of"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(counts="cols"))
    with pytest.raises(ValueError, match="slots must be one of"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(slots="both"))
    with pytest.raises(ValueError, match="dests must be one of"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(dests="kept"))
    with pytest.raises(ValueError, match='dests="stored" is an option of scatter="ranks"'):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(dests="stored"))
    with pytest.raises(ValueError, match="staging must be one of"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(staging="int16"))
    with pytest.raises(ValueError, match='staging="int32" is an option of scatter="ranks"'):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(staging="int32"))
    with pytest.raises(ValueError, match="ahead must be 2 or 4"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(ahead=3))
    with pytest.raises(ValueError, match="prefetch must be True or False"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(prefetch=1))
    with pytest.raises(ValueError, match="snaps must be one of"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(snaps="int8"))
    with pytest.raises(ValueError, match="narrow must be True or False"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(narrow=1))
    with pytest.raises(ValueError, match="l2_prefetch must be True or False"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(l2_prefetch=1))
    with pytest.raises(ValueError, match='l2_prefetch=True is an option of scatter="ranks"'):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(l2_prefetch=True))
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="l2_ahead must be an int >= 0"):
            v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(l2_ahead=bad))
    with pytest.raises(ValueError, match='l2_ahead > 0 is an option of scatter="ranks"'):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(l2_ahead=264))
    with pytest.raises(ValueError, match='narrow=True is an option of scatter="ranks"'):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(narrow=True))
    with pytest.raises(ValueError, match="reverse must be True or False"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(reverse=1))
    both = v5.V5Config(scatter="ranks", reverse=True, l2_ahead=4)
    with pytest.raises(ValueError, match="reverse=True and l2_ahead > 0 do not combine"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=both)
    for bad in (-1, 4, True):
        with pytest.raises(ValueError, match="diag_skip must be 0, 1, 2 or 3"):
            v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(diag_skip=bad))
    with pytest.raises(ValueError, match='diag_skip > 0 is an option of scatter="ranks"'):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(diag_skip=1))
    for knob in ("slots='pos'", "dests='stored'", "ahead=4", "narrow=True", "l2_ahead=3"):
        cfg = eval(f'v5.V5Config(scatter="atomic", {knob})')
        with pytest.raises(ValueError, match='scatter="atomic" takes tile, .* got ' + knob):
            v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=cfg)
    for bad in (-1, 16385, True, 2.0):
        cfg = v5.V5Config(scatter="atomic", run_limit=bad)
        with pytest.raises(ValueError, match="run_limit must be an int in \\[0, 16384\\]"):
            v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=cfg)
    with pytest.raises(ValueError, match='run_limit is an option of scatter="atomic"'):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=v5.V5Config(run_limit=0))
    small = v5.V5Config(tile=256, scatter_warps=16, scatter="ranks")
    with pytest.raises(ValueError, match="tile >= 32 \\* scatter_warps"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, config=small)
    with pytest.raises(ValueError, match="no weights"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2, weights=torch.ones(4))
    with pytest.raises(ValueError, match="world_size <= 4096"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 5000)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        v5.ranged_dispatch_v5(vals, lengths, blocks, 2)


def test_default_configs_are_valid_at_every_world_size() -> None:
    """`default_config_v5` gives a configuration the kernels take (`check_config`) and
    whose staging fits (`v5_supported`) at every W v5 supports, with the measured
    switch points."""
    v5 = _v5()
    for world in range(1, v5.V5_MAX_WORLD + 1):
        cfg = v5.default_config_v5(world)
        v5.check_config(cfg)
        assert v5.v5_supported(world, None, cfg), world
    assert v5.default_config_v5(31).scatter == "staged"
    assert v5.default_config_v5(32).scatter == "ranks"
    assert v5.default_config_v5(257).scatter_warps == 16
    # from W = 512 both cards run the H100's large-W choices (the H200 since session 44)
    assert v5.default_config_v5(511).tile == 4096
    big = {1024: 8192, 1025: 16384, 2048: 16384, 2049: 8192}
    for world, tile in big.items():
        cfg = v5.default_config_v5(world)
        assert (cfg.tile, cfg.staging, cfg.prefetch, cfg.snaps) == (tile, "int32", True, "int16")
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL"):  # H100: 2048-id tiles to
        for world in range(1, v5.V5_MAX_WORLD + 1):  # W = 64 (sessions 42, 47), 4096-id
            cfg = v5.default_config_v5(world, name)  # to 511, int32 staging from 512
            small = world <= 64  # session 47: the H200's reversed config at W = 32..64
            tile = (
                2048 if small else 4096 if world < 512 else 16384 if 1024 < world <= 2048 else 8192
            )
            assert (cfg.tile, cfg.staging) == (tile, "int32" if tile > 4096 else "int64")
            assert cfg.scatter == "ranks", (name, world)
            assert cfg.reverse == (32 <= world <= 64), (name, world)
            if 32 <= world <= 64:
                assert cfg == v5.default_config_v5(world, "NVIDIA H200"), world
            assert (cfg.scatter_warps, cfg.count_warps, cfg.unroll) == (
                (8, 4, 4) if small else (16, 8, 2)
            ), (name, world)
            # session 36: int16 snapshots everywhere, placement prefetch from W = 512
            assert (cfg.snaps, cfg.prefetch) == ("int16", world >= 512), (name, world)
            assert v5.v5_supported(world, None, cfg), (name, world)
    for name in ("NVIDIA H200", "NVIDIA GH200 480GB", None):  # the H200 table
        assert v5.default_config_v5(8, name) == v5.default_config_v5(8)
        for world in range(1, 512):  # session 47: reversed tiles below 256, int16 snaps
            cfg = v5.default_config_v5(world, name)
            assert cfg.tile == (2048 if world < 256 else 4096), (name, world)
            assert cfg.reverse == (world < 256), (name, world)
            assert cfg.snaps == ("int32" if world < 32 else "int16"), (name, world)
        for world in (512, 1024, 2048, 4096):  # session 44: the H100's choices from 512
            h100 = v5.default_config_v5(world, "NVIDIA H100 80GB HBM3")
            assert v5.default_config_v5(world, name) == h100


def test_table_override_names_the_other_cards_table(monkeypatch) -> None:
    """``FREESCALE_V5_TABLE`` (a benchmark knob) makes `default_config_v5` use the named
    card's table whatever the card; unset, the card's own; anything else is an error."""
    v5 = _v5()
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    monkeypatch.delenv(v5.TABLE_ENV, raising=False)
    assert v5.table_name(h200) == h200 and v5.table_name(None) is None
    monkeypatch.setenv(v5.TABLE_ENV, "H100")
    assert v5.default_config_v5(128, v5.table_name(h200)) == v5.default_config_v5(128, h100)
    assert v5.default_config_v5(128, v5.table_name(h200)) != v5.default_config_v5(128, h200)
    monkeypatch.setenv(v5.TABLE_ENV, "H200")
    assert v5.default_config_v5(128, v5.table_name(h100)) == v5.default_config_v5(128, h200)
    # the tables differ below W = 256 only (session 47)
    assert v5.default_config_v5(128, h100) != v5.default_config_v5(128, h200)
    for world in (256, 511, 1024):
        assert v5.default_config_v5(world, h100) == v5.default_config_v5(world, h200)
    monkeypatch.setenv(v5.TABLE_ENV, "A100")
    with pytest.raises(ValueError, match="FREESCALE_V5_TABLE must be one of"):
        v5.table_name(h100)


def _run_fresh(tmp_path, code: str) -> dict:
    """Run `code` (a script printing one JSON line last) in a fresh Python process
    without TRITON_INTERPRET: compiling for sm_90 there is independent of the patches
    Triton's interpreter applies to its language module while interpreted kernels run
    in this process (a Gluon compile after the v4 tests failed in-process on a cold
    Triton cache)."""
    script = tmp_path / "compile_v5_case.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_ptxas
@pytest.mark.parametrize(
    "world,tile,warps,unroll,modulo,dtype,scatter,counts,slots,dests,staging,knobs",
    [
        (1, 256, 1, 1, False, "int32", "staged", "rows", "dest", "recompute", "int64", ""),
        (7, 256, 2, 2, True, "int64", "staged", "columns", "pos", "recompute", "int64", ""),
        (1000, 1024, 8, 8, False, "int32", "staged", "rows", "dest", "recompute", "int64", ""),
        (1024, 4096, 8, 4, False, "int64", "staged", "rows", "pos", "recompute", "int64", ""),
        (4096, 2048, 4, 4, True, "int64", "staged", "columns", "dest", "recompute", "int64", ""),
        (1, 256, 1, 1, False, "int32", "ranks", "rows", "pos", "recompute", "int64", ""),
        (7, 256, 8, 2, True, "int64", "ranks", "rows", "dest", "recompute", "int64", ""),
        (1024, 4096, 8, 4, False, "int64", "ranks", "columns", "dest", "recompute", "int64", ""),
        (4096, 2048, 4, 4, True, "int32", "ranks", "rows", "pos", "recompute", "int64", ""),
        (1023, 4096, 16, 2, False, "int64", "ranks", "rows", "pos", "recompute", "int64", ""),
        (1, 256, 8, 1, True, "int32", "ranks", "rows", "dest", "stored", "int64", ""),
        (1024, 4096, 16, 2, False, "int64", "ranks", "rows", "pos", "stored", "int64", ""),
        (4096, 2048, 4, 4, False, "int64", "ranks", "rows", "dest", "stored", "int64", ""),
        (7, 256, 8, 2, True, "int32", "ranks", "rows", "dest", "recompute", "int32", ""),
        (1024, 4096, 16, 2, False, "int64", "ranks", "rows", "dest", "recompute", "int32", ""),
        (1024, 4096, 16, 4, False, "int64", "ranks", "rows", "pos", "stored", "int32", ""),
        (1000, 8192, 16, 2, True, "int64", "ranks", "rows", "dest", "recompute", "int32", ""),
        (2048, 16384, 16, 2, False, "int32", "ranks", "rows", "dest", "recompute", "int32", ""),
        (4096, 8192, 16, 2, True, "int64", "ranks", "rows", "dest", "recompute", "int32", ""),
        (1024, 8192, 16, 2, False, "int64", "ranks", "rows", "dest", "recompute", "int32",
         "ahead=4"),
        (7, 256, 4, 1, True, "int32", "ranks", "rows", "pos", "recompute", "int64", "ahead=4"),
        (1024, 8192, 16, 2, False, "int64", "ranks", "rows", "dest", "recompute", "int32",
         "prefetch=True"),
        (7, 256, 4, 2, True, "int64", "ranks", "rows", "pos", "stored", "int64", "prefetch=True"),
        (1024, 8192, 16, 2, False, "int64", "ranks", "rows", "dest", "recompute", "int32",
         'snaps="int16"'),
        (7, 256, 2, 2, True, "int32", "staged", "columns", "dest", "recompute", "int64",
         'snaps="int16"'),
        (1024, 8192, 16, 2, False, "int64", "ranks", "rows", "dest", "recompute", "int32",
         'prefetch=True, snaps="int16", narrow=True'),
        (1000, 2048, 8, 4, False, "int32", "ranks", "rows", "pos", "stored", "int64",
         "narrow=True"),
        (7, 256, 4, 2, True, "int64", "ranks", "rows", "dest", "recompute", "int64",
         "narrow=True"),
        (1024, 8192, 16, 2, False, "int64", "ranks", "rows", "dest", "recompute", "int32",
         'prefetch=True, snaps="int16", l2_prefetch=True'),
        (7, 256, 4, 2, True, "int32", "ranks", "rows", "pos", "stored", "int64",
         "l2_prefetch=True, narrow=True"),
        (1024, 8192, 16, 2, False, "int64", "ranks", "rows", "dest", "recompute", "int32",
         'prefetch=True, snaps="int16", l2_ahead=264'),
        (64, 2048, 8, 4, False, "int64", "ranks", "rows", "dest", "recompute", "int64",
         'snaps="int16", reverse=True'),
        (7, 256, 4, 2, True, "int32", "staged", "rows", "dest", "recompute", "int64",
         "reverse=True"),
        (1, 256, 1, 1, False, "int32", "atomic", "rows", "dest", "recompute", "int64", ""),
        (7, 256, 4, 2, True, "int64", "atomic", "columns", "dest", "recompute", "int32",
         "prefetch=True, reverse=True"),
        (1024, 8192, 16, 2, False, "int64", "atomic", "rows", "dest", "recompute", "int32",
         'prefetch=True, snaps="int16"'),
        (4096, 2048, 8, 4, True, "int32", "atomic", "rows", "dest", "recompute", "int64", ""),
        # session 50: LONG tiles ranked by warp 0 alone (256-id tiles hold no rows of 1024)
        (1024, 256, 4, 2, False, "int64", "atomic", "rows", "dest", "recompute", "int64",
         "run_limit=0"),
    ],
)  # fmt: skip
def test_kernels_compile_with_the_reserved_layout(
    tmp_path,
    world,
    tile,
    warps,
    unroll,
    modulo,
    dtype,
    scatter,
    counts,
    slots,
    dests,
    staging,
    knobs,
):
    """Both kernels compile for sm_90 with their shared-memory layout checked
    (`compile_v5` raises otherwise), within the per-program limit, and use the PTX
    they are built on."""
    got = _run_fresh(
        tmp_path,
        f"""
import json
import torch
from freescale.kernels import triton_dispatch_v5 as v5
cfg = v5.V5Config(tile={tile}, count_warps={warps}, scatter_warps={warps}, unroll={unroll},
                  scatter="{scatter}", counts="{counts}", slots="{slots}", dests="{dests}",
                  staging="{staging}", **dict({knobs}))
kernels = v5.compile_v5({world}, cfg, modulo={modulo}, values_dtype=torch.{dtype})
ptx = kernels["scatter"].asm["ptx"]
used = ("st.shared.u64", "st.shared.u16", "shfl.sync.up")
if cfg.scatter == "atomic":  # shared atomics, the runs' rank loop; LONG tiles: match.any
    used += ("atom.shared.add.u32", "RUN_LOOP", "match.any.sync", "bar.warp.sync")
else:
    used += ("match.any.sync", "bar.warp.sync")
used += ("atom.shared.add.u32",) if cfg.scatter == "staged" else ()
used += ("st.shared.u32",) if cfg.slots == "pos" else ()
assert "atom.shared" in kernels["count"].asm["ptx"]
assert "div.s64" not in ptx  # block owners without a 64-bit division (v4's _owner)
print(json.dumps({{
    "supported": v5.v5_supported({world}, None, cfg),
    "shared": kernels["scatter"].metadata.shared,
    "needed": v5.scatter_smem_bytes(cfg, {world}),
    "limit": v5.SMEM_LIMIT,
    "missing": [i for i in used if i not in ptx],
    # int16 snapshots: the count kernel's only 16-bit global stores
    "snaps16": ("st.global.b16" in kernels["count"].asm["ptx"]) == (cfg.snaps == "int16"),
    # l2_prefetch / l2_ahead: the bulk L2 prefetch, in the ranks scatter only
    "l2": ("cp.async.bulk.prefetch.L2" in ptx) == (cfg.l2_prefetch or cfg.l2_ahead > 0),
    # reverse / l2_ahead: the only readers of the grid size in the scatter
    "grid": ("%nctaid.x" in ptx) == (cfg.reverse or cfg.l2_ahead > 0),
    # narrow, int64 ids in block mode: both kernels hold the 32-bit path (int32 -> float
    # estimates) next to the 64-bit one (int32 ids are estimated from int32 either way)
    "narrow": "{dtype}" == "int32" or {modulo} or all(
        ("cvt.rn.f32.s32" in k.asm["ptx"]) == cfg.narrow and "cvt.rn.f32.s64" in k.asm["ptx"]
        for k in kernels.values()),
}}))
""",
    )
    assert got["snaps16"]
    assert got["narrow"]
    assert got["l2"]
    assert got["grid"]
    assert got["supported"]
    assert got["needed"] <= got["shared"] <= got["limit"]
    assert got["missing"] == []


@needs_ptxas
def test_int32_staging_fits_three_scatter_programs_per_sm(tmp_path) -> None:
    """What ``staging="int32"`` is for: at W = 1024 with 4096-id tiles and 16 warps (the
    H100's config there) three scatter programs fit an SM (228 KiB of shared memory, 1
    KiB reserved per program; 64K registers), where the int64 staging fits two."""
    got = _run_fresh(
        tmp_path,
        """
import json, os, re, subprocess, tempfile
import triton
from freescale.kernels import triton_dispatch_v5 as v5
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
out = {}
for staging in ("int64", "int32"):
    cfg = v5.V5Config(tile=4096, count_warps=8, scatter_warps=16, unroll=2, scatter="ranks",
                      staging=staging)
    k = v5.compile_v5(1024, cfg)["scatter"]
    regs = None
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
        regs = int(re.search(r"REG:(\\d+)", usage).group(1))
    out[staging] = {"shared": k.metadata.shared, "regs": regs}
print(json.dumps(out))
""",
    )
    per_sm, per_program = 228 * 1024, 1024
    for staging, programs in (("int64", 2), ("int32", 3)):
        shared = got[staging]["shared"] + per_program
        assert per_sm // shared == programs, (staging, got)
    regs = got["int32"]["regs"]
    if regs is not None:  # Triton's bundled cuobjdump: 3 programs of 512 threads
        assert 3 * 512 * regs <= 65536, got


@needs_ptxas
def test_diag_skip_removes_exactly_its_stores(tmp_path) -> None:
    """``V5Config(diag_skip=...)`` (timing diagnostics): 1 drops the write-out's global
    stores, 2 the perm stores, 3 both; 0 compiles the same scatter as a config without
    the field (the default path is untouched)."""
    got = _run_fresh(
        tmp_path,
        """
import json
from freescale.kernels import triton_dispatch_v5 as v5
base = dict(tile=8192, count_warps=8, scatter_warps=16, unroll=2, scatter="ranks",
            staging="int32", prefetch=True, snaps="int16")
ptx = {k: v5.compile_v5(1024, v5.V5Config(**base, diag_skip=k))["scatter"].asm["ptx"]
       for k in (0, 1, 2, 3)}
plain = v5.compile_v5(1024, v5.V5Config(**base))["scatter"].asm["ptx"]
print(json.dumps({"stores": {k: p.count("st.global") for k, p in ptx.items()},
                  "same": ptx[0] == plain}))
""",
    )
    n = {int(k): v for k, v in got["stores"].items()}
    assert got["same"]
    assert n[3] < n[1] < n[0] and n[3] < n[2] < n[0], n
    assert n[0] - n[1] == n[2] - n[3] and n[0] - n[2] == n[1] - n[3], n  # independent


@needs_ptxas
def test_table_kernels_compile_for_sm90(tmp_path) -> None:
    """v4's and v5's table launches (`triton_dispatch_v4.launch_tables`) compile for sm_90:
    the many-program segment offsets in both prefix modes (the prefixed one, used past
    `SEG_SUMS_MAX_BLOCKS` blocks, runs in CI's interpreter only), the block-sum scan and
    the k-ary tile table."""
    got = _run_fresh(
        tmp_path,
        """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freescale.kernels import triton_dispatch_v4 as v4

def build(fn, sig, const, warps):
    src = ASTSource(fn, signature={**sig, **dict.fromkeys(const, "constexpr")}, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

i64 = "*i64"
done = []
for prefixed in (False, True):
    build(v4._v4_seg_scan_kernel,
          {"lengths_ptr": i64, "block_sums_ptr": i64, "seg_offsets_ptr": i64,
           "num_segments": "i32"},
          {"BLOCK": 2048, "SUMS_BLOCK": 1024, "PREFIXED": prefixed}, 8)
    done.append(f"scan prefixed={prefixed}")
build(v4._v4_sums_scan_kernel, {"block_sums_ptr": i64, "num_blocks": "i32"}, {"BLOCK": 2048}, 8)
done.append("sums scan")
table = {"seg_offsets_ptr": i64, "key_tile_first_ptr": i64, "tile_key_ptr": "*i32",
         "tile_start_ptr": i64, "tile_end_ptr": i64, "tile_seg_lo_ptr": i64,
         "tile_seg_hi_ptr": i64, "num_tiles": "i32", "num_keys": "i32", "batch": "i32"}
build(v4._v4_tile_table_kernel, table,
      {"TILE": 4096, "KEY_ROUNDS": 1, "SEG_ROUNDS": 4, "FAN": 16, "BLOCK": 256}, 4)
done.append("tile table")
print(json.dumps(done))
""",
    )
    assert got == ["scan prefixed=False", "scan prefixed=True", "sums scan", "tile table"]


def test_layout_check_catches_a_wrong_assumption(tmp_path) -> None:
    """Mutations of what `check_layout` is told (a missing buffer, the wrong order) and a
    kernel whose op needs scratch shared memory are all refused."""
    got = _run_fresh(
        tmp_path,
        """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from freescale.kernels import triton_dispatch_v5 as v5


@gluon.jit
def with_scratch(x_ptr):  # a layout change across warps needs Triton's own scratch
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    other: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    buf = gl.allocate_shared_memory(gl.int32, [128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    x = gl.load(x_ptr + gl.arange(0, 128, layout=layout))
    buf.store(x)
    y = gl.convert_layout(buf.load(layout), other)
    gl.store(x_ptr + gl.arange(0, 128, layout=other), y)
    buf.store(x + 1)  # the buffer is live across the conversion's scratch
    gl.store(x_ptr + 128 + gl.arange(0, 128, layout=layout), buf.load(layout))


def outcome(fn):
    try:
        fn()
        return "ok"
    except RuntimeError as exc:
        return str(exc)


cfg = v5.V5Config(tile=1024, count_warps=4, scatter_warps=4, unroll=4)
scatter = v5.compile_v5(1024, cfg)["scatter"]
bufs = [4 * b for b in v5.buffer_words(v5.scatter_smem_bytes(cfg, 1024), 128) if b]
src = gluon._runtime.GluonASTSource(with_scratch, signature={"x_ptr": "*i32"})
scratch = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(json.dumps({
    "buffers": len(bufs),
    "right": outcome(lambda: v5.check_layout(scatter, bufs)),
    "missing": outcome(lambda: v5.check_layout(scatter, bufs[:-1])),
    "reversed": outcome(lambda: v5.check_layout(scatter, list(reversed(bufs)))),
    "scratch": outcome(lambda: v5.check_layout(scratch, [512])),
}))
""",
    )
    assert got["buffers"] > 1
    assert got["right"] == "ok"
    assert "some op needs scratch" in got["missing"]
    assert "largest first" in got["reversed"]
    assert "some op needs scratch" in got["scratch"]


# each GPU case runs in a fresh process: compile v5, run one call, print per output
# field whether it equals the reference
_GPU_HEAD = """
import json
import torch
from freescale.kernels import reference, triton_dispatch_v5 as v5
world, cfg = {world}, v5.V5Config(**{cfg})
"""
_GPU_TAIL = """ref = reference.ranged_dispatch(vals, lengths, blocks, world)
got = v5.ranged_dispatch_v5(vals, lengths, blocks, world, config=cfg)
fields = ("values", "lengths", "splits", "key_counts", "unbucketize_permute")
print(json.dumps({{f: torch.equal(getattr(ref, f), getattr(got, f)) for f in fields}}))
"""
_GPU_CASE = (
    _GPU_HEAD
    + """g = torch.Generator(device="cuda").manual_seed(world)
lengths = torch.randint(0, 300, (3 * 64,), device="cuda", generator=g)
n = int(lengths.sum())
vals = torch.randint(0, {rows}, (n,), device="cuda", generator=g)
blocks = torch.full((3,), -(-{rows} // world), device="cuda")
"""
    + _GPU_TAIL
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="v5 is Gluon: it runs on a CUDA GPU only")
@pytest.mark.parametrize(
    "scatter,slots,dests,staging,rows,knobs",
    [
        ("staged", "dest", "recompute", "int64", 10_000, ""),
        ("ranks", "dest", "recompute", "int64", 10_000, ""),
        ("ranks", "pos", "recompute", "int64", 10_000, ""),
        ("ranks", "dest", "stored", "int64", 10_000, ""),
        ("ranks", "pos", "stored", "int64", 10_000, ""),
        ("ranks", "dest", "recompute", "int32", 10_000, ""),
        ("ranks", "pos", "stored", "int32", 10_000, ""),
        # local rows past 2^31: int32 staging stores those values directly
        ("ranks", "dest", "recompute", "int32", 1 << 44, ""),
        ("ranks", "pos", "stored", "int32", 1 << 44, ""),
        ("ranks", "dest", "recompute", "int32", 1 << 44, "ahead=4"),
        ("ranks", "pos", "recompute", "int64", 10_000, "ahead=4"),
        ("ranks", "dest", "recompute", "int32", 1 << 44, "prefetch=True"),
        ("ranks", "pos", "stored", "int64", 10_000, "prefetch=True"),
        # int16 snapshots: counters up to ~9.6K ids (one key's ids in one 16384-id tile)
        ("ranks", "dest", "recompute", "int32", 1 << 44, 'tile=16384, snaps="int16"'),
        ("staged", "dest", "recompute", "int64", 10_000, 'snaps="int16"'),
        # the H100 table from W = 512 (session 36): timed, and checked at W <= 1024 by
        # kernels.py, but not as a test case before
        (
            "ranks",
            "dest",
            "recompute",
            "int32",
            1 << 44,
            'tile=16384, prefetch=True, snaps="int16"',
        ),
        # session 37: each warp's ids prefetched into L2 by one bulk request
        ("ranks", "dest", "recompute", "int32", 1 << 44, "prefetch=True, l2_prefetch=True"),
        ("ranks", "pos", "stored", "int64", 10_000, "l2_prefetch=True"),
        ("ranks", "dest", "recompute", "int64", 10_000, "l2_prefetch=True, narrow=True"),
        # session 39: the sub-ranges of the tile 3 ahead (past the grid: the last tile's)
        ("ranks", "dest", "recompute", "int32", 1 << 44, "prefetch=True, l2_ahead=3"),
        # session 47: the scatter takes the tiles last first
        ("ranks", "dest", "recompute", "int32", 1 << 44, "prefetch=True, reverse=True"),
        ("staged", "dest", "recompute", "int64", 10_000, "reverse=True"),
        # session 49: the atomic scatter (unordered ranks, then stable ranks within runs)
        ("atomic", "dest", "recompute", "int64", 10_000, ""),
        ("atomic", "dest", "recompute", "int32", 1 << 44, "prefetch=True"),
        ("atomic", "dest", "recompute", "int32", 1 << 44, 'tile=8192, snaps="int16"'),
        ("atomic", "dest", "recompute", "int64", 10_000, "unroll=1, reverse=True"),
        # session 50: the LONG path on every tile (ranking warps: 2 / 8 of 8 at W = 1024 /
        # 8 with 512-id tiles, 16 with 8192, 1 with 256-id tiles at W = 1024), on none;
        # the default limit of 64 takes it on most tiles at W = 1 and 8, none at 1024
        ("atomic", "dest", "recompute", "int32", 1 << 44, "prefetch=True, run_limit=0"),
        (
            "atomic",
            "dest",
            "recompute",
            "int32",
            1 << 44,
            "tile=8192, scatter_warps=16, unroll=2, prefetch=True, run_limit=0",
        ),
        ("atomic", "dest", "recompute", "int64", 10_000, "tile=256, run_limit=0"),
        ("atomic", "dest", "recompute", "int64", 10_000, "run_limit=16384"),
    ],
)
@pytest.mark.parametrize("world", [1, 8, 1024])
def test_v5_equals_reference_on_gpu(
    tmp_path,
    world: int,
    scatter: str,
    slots: str,
    dests: str,
    staging: str,
    rows: int,
    knobs: str,
) -> None:
    """Compiled on the GPU in a fresh process: this module (and others) import Triton in
    interpreter mode, where Gluon kernels cannot be compiled."""
    cfg = {
        "tile": 512,
        "scatter": scatter,
        "slots": slots,
        "dests": dests,
        "staging": staging,
        **eval(f"dict({knobs})"),  # e.g. "ahead=4"
    }
    got = _run_fresh(tmp_path, _GPU_CASE.format(world=world, cfg=cfg, rows=rows))
    assert all(got.values()), got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="v5 is Gluon: it runs on a CUDA GPU only")
@pytest.mark.parametrize("skip", [1, 2, 3])
@pytest.mark.parametrize("world", [8, 1024])
def test_v5_diag_skip_keeps_the_rest_on_gpu(tmp_path, world: int, skip: int) -> None:
    """A timing diagnostic skips only its own stores: with 1 every field but the values
    still equals the reference, with 2 every field but the permutation, with 3 neither."""
    cfg = {"tile": 8192, "scatter_warps": 16, "unroll": 2, "scatter": "ranks",
           "staging": "int32", "prefetch": True, "snaps": "int16", "diag_skip": skip}  # fmt: skip
    got = _run_fresh(tmp_path, _GPU_CASE.format(world=world, cfg=cfg, rows=1 << 44))
    skipped = ({"values"} if skip % 2 else set()) | (
        {"unbucketize_permute"} if skip // 2 else set()
    )
    assert all(ok for f, ok in got.items() if f not in skipped), (skipped, got)


_GPU_NARROW_CASE = (
    _GPU_HEAD
    + """g = torch.Generator(device="cuda").manual_seed(world + 1)
# key 0: block size at narrow_ok's limit; key 1: 2^40 (the 64-bit path); key 2: small
# blocks with ids past blk * W and ids past 2^32 whose low word lies in range
blocks = torch.tensor([(2**31 - 1) // (world + 1), 1 << 40, 977], device="cuda")
lengths = torch.randint(0, 300, (3 * 64,), device="cuda", generator=g)
per_key = lengths.view(3, 64).sum(1).tolist()
parts = []
for k, count in enumerate(per_key):
    top = int(blocks[k]) * world
    ids = (torch.rand(count, device="cuda", generator=g, dtype=torch.float64) * top).long()
    pick = torch.randint(0, 20, (count,), device="cuda", generator=g)
    past = top + torch.randint(0, 1 << 40, (count,), device="cuda", generator=g)
    high = (torch.randint(1, 256, (count,), device="cuda", generator=g) << 32) + ids
    parts.append(torch.where(pick == 0, past, torch.where(pick == 1, high, ids)))
vals = torch.cat(parts)
"""
    + _GPU_TAIL
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="v5 is Gluon: it runs on a CUDA GPU only")
@pytest.mark.parametrize(
    "knobs",
    [
        'tile=512, scatter="ranks", narrow=True',
        'tile=512, scatter="ranks", staging="int32", prefetch=True, snaps="int16", narrow=True',
        'tile=512, scatter="ranks", slots="pos", dests="stored", narrow=True',
        'tile=8192, scatter_warps=16, unroll=2, scatter="ranks", staging="int32", '
        'prefetch=True, snaps="int16", narrow=True',
    ],
)
@pytest.mark.parametrize("world", [1, 8, 1000, 1024])
def test_v5_narrow_equals_reference_on_gpu(tmp_path, world: int, knobs: str) -> None:
    """``V5Config(narrow=True)``: a key at `narrow_ok`'s block-size limit (32-bit path), a
    key past it (64-bit path) and a key with ids past blk * W and past 2^32 in one call,
    bitwise equal to the reference."""
    cfg = eval(f"dict({knobs})")
    got = _run_fresh(tmp_path, _GPU_NARROW_CASE.format(world=world, cfg=cfg))
    assert all(got.values()), got


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 70), (130, 64), (257, 1000)])
def test_transpose_kernel_equals_torch(rows: int, cols: int, monkeypatch) -> None:
    """`transpose_2d` (plain Triton, interpreted on CPU) against ``x.t().contiguous()`` on
    fresh random input: the count rows' reorder that feeds v4's scan."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 set before triton is imported, or a GPU")
    v5 = _v5()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randint(-(2**31), 2**31 - 1, (rows, cols), dtype=torch.int32, device=device)
    got = v5.transpose_2d(x, block=16 if device == "cpu" else 64)
    assert torch.equal(got, x.t().contiguous())


def _atomic_scatter_model(
    dest: torch.Tensor,
    world: int,
    order: torch.Tensor,
    run_limit: int = 16384,
    kr: int = 1,
    mutant: bool = False,
) -> tuple[torch.Tensor, bool]:
    """`_atomic_tile`'s steps on one tile in plain PyTorch, the shared atomics taken in
    the given `order` (any permutation of the input indices): the final tile slot of
    each input index and whether the tile was LONG (a1: unordered ranks, LONG when one is
    >= run_limit; b: starts; LONG, step o: `kr` ranking warps of tile / kr ids count,
    scan per dest over the warps, then walk their ids in order; a2: input indices by
    slot; a3: rank within the run = input indices of the run below one's own, or on a
    LONG tile the slot itself). `mutant`: the ranking warps walk their ids last first."""
    n = dest.numel()
    counters = [0] * (world + 1)
    u = torch.empty(n, dtype=torch.long)
    for i in order.tolist():  # a1
        u[i] = counters[int(dest[i])]
        counters[int(dest[i])] += 1
    long_tile = bool(n) and int(u.max()) >= run_limit
    starts = torch.zeros(world + 1, dtype=torch.long)  # b: entry W = n
    starts[1:] = torch.cumsum(torch.tensor(counters[:world]), 0)
    if long_tile:  # o: u becomes the final slot
        tile = 1 << max(n - 1, 1).bit_length()
        sub = tile // kr
        rows = torch.zeros(kr, world, dtype=torch.long)
        for i in range(n):
            rows[i // sub, int(dest[i])] += 1
        first = starts[:world] + torch.cumsum(rows, 0) - rows  # each warp's first slot
        for wk in range(kr):  # the warps walk concurrently; each in input order
            walk = range(wk * sub, min(n, wk * sub + sub))
            for i in reversed(walk) if mutant else walk:
                d = int(dest[i])
                u[i] = first[wk, d]
                first[wk, d] += 1
    slot = u if long_tile else starts[dest] + u
    li_by_slot = torch.empty(n, dtype=torch.long)  # a2
    li_by_slot[slot] = torch.arange(n)
    final = torch.empty(n, dtype=torch.long)
    for p in range(n):  # a3
        li, d = int(li_by_slot[p]), int(dest[li_by_slot[p]])
        if long_tile:
            final[li] = p
        else:
            run = li_by_slot[starts[d] : starts[d + 1]]
            final[li] = starts[d] + int((run < li).sum())
    return final, long_tile


@pytest.mark.parametrize("world,n", [(1, 50), (7, 300), (64, 1000), (1024, 3000)])
def test_atomic_scatter_model_gives_the_stable_order_for_any_atomic_order(world, n) -> None:
    """The atomic scatter's argument, on CPU (its Gluon kernel runs on a GPU only, where
    `test_v5_equals_reference_on_gpu` compares its bits): whatever order the shared
    atomics take, the rank within each dest's run restores the stable sort by dest of
    the tile, the order `reference.ranged_dispatch` gives; so does a LONG tile's ranking
    in input order (session 50), whichever the limit and the number of ranking warps."""
    g = torch.Generator().manual_seed(world * 7 + n)
    dest = torch.randint(0, world, (n,), generator=g)
    dest[: n // 10] = 0  # one long run
    stable = torch.empty(n, dtype=torch.long)
    stable[torch.sort(dest, stable=True).indices] = torch.arange(n)
    longest = int(torch.bincount(dest).max())
    for order in (torch.arange(n), torch.arange(n).flip(0), torch.randperm(n, generator=g)):
        for run_limit, kr in ((16384, 1), (0, 1), (0, 4), (64, 16), (longest, 2)):
            got, long_tile = _atomic_scatter_model(dest, world, order, run_limit, kr)
            assert long_tile == (longest > run_limit), (run_limit, longest)
            assert torch.equal(got, stable), (run_limit, kr)


def test_atomic_scatter_model_catches_a_long_tile_walked_out_of_order() -> None:
    """The model's comparison can fail: LONG tiles whose ranking warps walk their ids
    last first (a wrong chunk order in step o) break the stable order."""
    g = torch.Generator().manual_seed(3)
    dest = torch.randint(0, 4, (200,), generator=g)
    stable = torch.empty(200, dtype=torch.long)
    stable[torch.sort(dest, stable=True).indices] = torch.arange(200)
    for kr in (1, 2):
        got, long_tile = _atomic_scatter_model(dest, 4, torch.arange(200), 0, kr)
        assert long_tile and torch.equal(got, stable)
        got, long_tile = _atomic_scatter_model(dest, 4, torch.arange(200), 0, kr, mutant=True)
        assert long_tile and not torch.equal(got, stable)
