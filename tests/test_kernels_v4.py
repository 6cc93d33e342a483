"""Triton dispatch v4 (`triton_dispatch_v4.ranged_dispatch_v4`) against the reference.

Bitwise (every field, dtypes included) on fresh random jagged inputs per run, in Triton's
interpreter on CPU (TRITON_INTERPRET=1), with tiny tiles so that every run covers many
tiles per key, several chunks per tile, segments spanning tiles (with whole tiles in
between) and tiles holding many segments. Both ways of making the output lengths are
checked: ``lengths_mode="rows"`` (the default: per-segment counter snapshot rows and a
blocked finish pass) and ``"columns"`` (the first v4: lengths stored per segment as W
strided stores, crossing segments fixed up in the finish kernel). Each test prints its
seed; replay with FREESCALE_TEST_SEED=<seed>. Compilation and speed are checked on the
GPU machine (`benchmarks/kernels.py`, variant "triton_v4").
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from freescale.kernels import reference  # noqa: E402
from freescale.kernels.common import triton_available  # noqa: E402

try:
    from _kernel_cases import SEED_ENV_VAR, assert_dispatch_equal, fresh_seed, random_dispatch_case
except ImportError:  # tests/ imported as a package
    from tests._kernel_cases import (
        SEED_ENV_VAR,
        assert_dispatch_equal,
        fresh_seed,
        random_dispatch_case,
    )

pytestmark = pytest.mark.skipif(
    not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton missing, or TRITON_INTERPRET was not 1 when this module was imported",
)

torch.set_num_threads(1)

INDEX_DTYPES = [torch.int32, torch.int64]
LENGTHS_MODES = ["rows", "columns"]
# (tile, chunk, scatter_block); None = the CPU defaults (64, 16, 32)
CONFIGS = [(16, 16, 16), (None, None, None), (64, 32, 16), (128, 32, 64)]


@pytest.fixture
def gen() -> torch.Generator:
    seed = fresh_seed()
    print(f"seed={seed} (replay with {SEED_ENV_VAR}={seed})")
    return torch.Generator().manual_seed(seed)


def _v4():
    from freescale.kernels import triton_dispatch_v4

    return triton_dispatch_v4


def _dtypes(i: int) -> dict:
    return {"values_dtype": INDEX_DTYPES[i % 2], "lengths_dtype": INDEX_DTYPES[(i // 2) % 2]}


def _check(args, mode="block", weights=None, context="", **knobs) -> None:
    expected = reference.ranged_dispatch(*args, mode=mode, weights=weights)
    actual = _v4().ranged_dispatch_v4(*args, mode=mode, weights=weights, **knobs)
    assert_dispatch_equal(expected, actual, f"{mode} {knobs} {context}")


@pytest.mark.parametrize("lengths_mode", LENGTHS_MODES)
@pytest.mark.parametrize("world", [1, 3, 8, 300, 1024])
@pytest.mark.parametrize("mode", ["block", "modulo"])
def test_v4_matches_reference(gen, world, mode, lengths_mode):
    """Random batches: empty segments, ids at block borders and past blk*W, table rows not
    divisible by W, int32/int64 ids and lengths, with and without weights."""
    for i, (tile, chunk, block) in enumerate(CONFIGS):
        case = random_dispatch_case(
            gen, world, max_batch=6, max_len=70, with_weights=i % 2 == 0, **_dtypes(world + i)
        )
        args = (case.values, case.lengths, case.block_sizes, world)
        # both scatter orders: a tile's blocks adjacent (default) and the first v4's;
        # both ways to find a tile's offsets: one row per program (default) or per id
        order = ("tile", "block")[i % 2]
        et_gather = ("row", "row", "global", "global")[i]
        _check(args, mode, case.weights, case.describe(), tile=tile, chunk=chunk,
               scatter_block=block, lengths_mode=lengths_mode, scatter_order=order,
               et_gather=et_gather)  # fmt: skip


@pytest.mark.parametrize("world", [1, 5, 300, 1024])
def test_v4_rows_many_finish_blocks(gen, world):
    """lengths_mode="rows" with more segments and tiles than one finish block holds (and W
    not a multiple of its dest block), at several finish block sizes: every program range
    of `_v4_finish_rows_kernel` (et blocks, lengths blocks, splits) runs several times."""
    for i, (finish_block, tile) in enumerate(((16, 16), (32, 64), (16, 128))):
        case = random_dispatch_case(
            gen, world, max_batch=24, max_len=40, with_weights=i == 0, **_dtypes(world + i)
        )
        args = (case.values, case.lengths, case.block_sizes, world)
        mode = ("block", "modulo")[i % 2]
        _check(args, mode, case.weights, case.describe(), tile=tile,
               finish_block=finish_block, lengths_mode="rows")  # fmt: skip


def _fixed(lengths: list[int], ids, blocks: list[int], dtypes) -> tuple:
    values_dtype, lengths_dtype = dtypes
    return (
        torch.as_tensor(ids).to(values_dtype),
        torch.tensor(lengths, dtype=lengths_dtype),
        torch.tensor(blocks, dtype=values_dtype),
    )


@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int64), (torch.int64, torch.int32)])
def test_v4_edge_cases(gen, dtypes):
    """Segments across many tiles, a key without ids, trailing empty segments, one dest
    for every id, W=1024 with few ids, ids exactly at the range borders."""
    cases = []
    # K=2, B=3: a 150-id segment spans ~10 tiles of 16 (whole tiles in between), 41 ids
    # cross a tile border, empty segments at both ends of a key
    lengths = [0, 150, 3, 0, 0, 41]
    n = sum(lengths)
    cases += [
        (lengths, 4, torch.randint(0, 40, (n,), generator=gen), [10, 10]),
        (lengths, 4, torch.full((n,), 7), [3, 3]),  # every id to dest 2 (7 // 3)
        (lengths, 4, torch.arange(n) % 3, [1, 1]),  # dests 0..2 interleaved, dest 3 empty
        (lengths, 1024, torch.randint(0, 5000, (n,), generator=gen), [5, 5]),  # past blk*W
    ]
    # key 0 without ids (one empty tile owns its segments), key 2 ends with empty segments
    lengths = [0, 0, 0, 5, 37, 0, 20, 0, 0]
    n = sum(lengths)
    cases.append((lengths, 7, torch.randint(0, 200, (n,), generator=gen), [4, 9, 30]))
    # ids at every border of W=5 blocks of 6 rows (blk*W = 30) and beyond
    borders = [0, 5, 6, 11, 12, 23, 24, 29, 30, 31, 59, 60, 61, 1000]
    cases.append(([len(borders)], 5, torch.tensor(borders), [6]))
    # W=1024, a handful of ids, all but one segment empty
    cases.append(([0, 0, 5, 0], 1024, torch.tensor([0, 1023, 5, 1024, 99]), [1, 1]))
    # a single id; one segment much longer than a tile
    cases.append(([1], 3, torch.tensor([2]), [1]))
    cases.append(([333], 2, torch.randint(0, 10, (333,), generator=gen), [5]))
    # segment and key borders on tile borders (16 and 32 are multiples of every tile used
    # here but 32 / 64-id tiles): empty segments at a key's end owned by its last tile
    lengths = [16, 0, 0, 32, 0, 16, 0, 0, 0]
    n = sum(lengths)
    cases.append((lengths, 1024, torch.randint(0, 3000, (n,), generator=gen), [2, 3, 1]))
    # W=1024, every id to the last dest (blk*W - 1) or to dest 0, one segment per key
    cases.append(([40, 0, 9], 1024, torch.tensor([1023] * 30 + [0] * 19), [1, 1, 1]))
    # W=1, several keys, empty segments everywhere
    lengths = [0, 7, 0, 0, 20, 0]
    n = sum(lengths)
    cases.append((lengths, 1, torch.randint(0, 50, (n,), generator=gen), [3, 50, 1]))
    # (mode, tile, chunk) per case, rotating so that every pair meets every knob setting
    runs = [("block", 16, 16), ("modulo", 32, 32), ("block", None, None), ("modulo", 16, 16)]
    for i, (lengths, world, ids, blocks) in enumerate(cases):
        args = (*_fixed(lengths, ids, blocks, dtypes), world)
        weights = torch.rand(ids.numel(), generator=gen)
        for j, (mode, tile, chunk) in enumerate((runs[i % 4], runs[(i + 1) % 4])):
            for lengths_mode in LENGTHS_MODES:
                _check(args, mode, weights, f"W={world} lengths={lengths}", tile=tile,
                       chunk=chunk, lengths_mode=lengths_mode,
                       finish_block=16 if j else 32)  # fmt: skip


def test_v4_ids_fit_one_tile_or_many(gen):
    """N smaller than one tile (one program per key), and many full tiles per key."""
    for max_len, tile in ((3, 1024), (200, 16)):
        case = random_dispatch_case(gen, 8, max_keys=2, max_batch=3, max_len=max_len)
        args = (case.values, case.lengths, case.block_sizes, 8)
        _check(args, context=case.describe(), tile=tile)


class _Counted:
    """A Triton kernel whose launches are counted (``kernel[grid](...)`` passes through)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize(
    "table_block, fused_max, fan, scan_block, sums_max",
    [
        (16, 1 << 30, 16, 4, 4096),
        (16, 0, 2, 4, 4096),
        (1024, 0, 4, 1 << 20, 4096),
        (16, 1 << 30, 2, 4, 4096),
        (64, 0, 16, 8, 4096),
        (16, 0, 16, 4, 1),
    ],
)
def test_v4_tables_one_launch_or_two(
    gen, monkeypatch, table_block, fused_max, fan, scan_block, sums_max
):
    """The segment offsets and the tile table as one single-program launch (looping over
    several table blocks when ``FUSED_TABLE_BLOCK`` is small) or as separate launches
    (the path past `FUSED_TABLES_MAX_TILES` tiles: the offsets by one program up to
    `SEG_SCAN_BLOCK` segments, by many programs beyond, whose prefix loop adds
    `SEG_SUMS_BLOCK` = 2 block sums a pass here, or, past `SEG_SUMS_MAX_BLOCKS` blocks,
    which read the prefix that one more launch made), with several search fans
    (`SEARCH_FAN`: the rounds follow it): the reference's bits either way, and the
    launches are the ones chosen. A fixed case with 40+ tiles makes the fused loop run
    3+ times."""
    v4 = _v4()
    monkeypatch.setattr(v4, "TABLE_BLOCK", table_block)
    monkeypatch.setattr(v4, "FUSED_TABLE_BLOCK", table_block)
    monkeypatch.setattr(v4, "FUSED_TABLES_MAX_TILES", fused_max)
    monkeypatch.setattr(v4, "SEARCH_FAN", fan)
    monkeypatch.setattr(v4, "SEG_SCAN_BLOCK", scan_block)
    monkeypatch.setattr(v4, "SEG_SUMS_BLOCK", 2)
    monkeypatch.setattr(v4, "SEG_SUMS_MAX_BLOCKS", sums_max)
    monkeypatch.setattr(v4, "SEG_SUMS_SCAN_BLOCK", 2)  # several passes
    kernels = _count_table_launches(monkeypatch, v4)
    many = torch.randint(0, 5000, (700,), generator=gen)
    fixed = (many, torch.tensor([0, 300, 1, 399, 0, 0]), torch.tensor([700, 1200]), 8)
    cases = [(fixed, None, "fixed: 2 keys, 700 ids, 44 tiles of 16")]
    for world in (8, 300, 3):
        case = random_dispatch_case(gen, world, max_batch=9, max_len=120, with_weights=True)
        cases.append(((case.values, case.lengths, case.block_sizes, world), case.weights,
                      case.describe()))  # fmt: skip
    calls = many_program_scans = 0
    for (args, weights, context), tile in zip(cases, (16, 16, 16, 64)):
        for lengths_mode in LENGTHS_MODES:
            _check(args, "block", weights, context, tile=tile, lengths_mode=lengths_mode)
            calls += args[0].numel() > 0
            many_program_scans += args[0].numel() > 0 and args[1].numel() > scan_block
    fused = kernels["_v4_tables_kernel"].launches
    assert fused == (calls if fused_max else 0)
    scans = kernels["_v4_seg_scan_kernel"].launches
    assert scans == (0 if fused_max else many_program_scans)
    assert kernels["_v4_segment_kernel"].launches == calls - fused - scans
    assert kernels["_v4_tile_table_kernel"].launches == calls - fused
    if not fused_max and scan_block == 4:
        assert scans > 0  # the many-program offsets ran
    prefixed = kernels["_v4_sums_scan_kernel"].launches
    assert prefixed == (scans if sums_max == 1 else 0)


def _count_table_launches(monkeypatch, v4) -> dict:
    names = ("_v4_tables_kernel", "_v4_segment_kernel", "_v4_seg_scan_kernel",
             "_v4_sums_scan_kernel", "_v4_tile_table_kernel")  # fmt: skip
    kernels = {name: _Counted(getattr(v4, name)) for name in names}
    for name, counted in kernels.items():
        monkeypatch.setattr(v4, name, counted)
    return kernels


def test_v4_tables_fused_up_to_the_limit(gen, monkeypatch):
    """`FUSED_TABLES_MAX_TILES` is inclusive: a call with exactly that many tiles (N //
    tile + K) takes the one-launch path, one more tile takes two launches."""
    v4 = _v4()
    n, keys, tile = 160, 2, 16
    tiles = n // tile + keys  # 12
    values = torch.randint(0, 1000, (n,), generator=gen)
    args = (values, torch.tensor([50, 30, 40, 40]), torch.tensor([300, 500]), 4)
    for limit, fused in ((tiles, 1), (tiles - 1, 0)):
        monkeypatch.setattr(v4, "FUSED_TABLES_MAX_TILES", limit)
        kernels = _count_table_launches(monkeypatch, v4)
        _check(args, context=f"limit {limit}", tile=tile)
        assert kernels["_v4_tables_kernel"].launches == fused, limit
        assert kernels["_v4_segment_kernel"].launches == 1 - fused, limit
        for name, counted in kernels.items():  # unwrap for the next round
            monkeypatch.setattr(v4, name, counted.kernel)


if triton_available():
    import triton
    import triton.language as tl

    from freescale.kernels.triton_dispatch_v4 import _first_at_least

    @triton.jit
    def _search_kernel(sorted_ptr, lo_ptr, hi_ptr, target_ptr, out_ptr, n, STRICT: tl.constexpr,
                       ROUNDS: tl.constexpr, FAN: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """out[i] = `_first_at_least` over sorted[lo[i]:hi[i]] for target[i]."""
        i = tl.arange(0, BLOCK)
        m = i < n
        lo = tl.load(lo_ptr + i, mask=m, other=0)
        hi = tl.load(hi_ptr + i, mask=m, other=0)
        target = tl.load(target_ptr + i, mask=m, other=0)
        found = _first_at_least(sorted_ptr, lo, hi, target, m, STRICT, ROUNDS, FAN)
        tl.store(out_ptr + i, found, mask=m)


@pytest.mark.parametrize("fan", [2, 4, 16])
def test_kary_search_matches_searchsorted(gen, fan):
    """`_first_at_least` (the tile table's k-ary search) against torch.searchsorted on
    fresh random non-decreasing arrays with runs of equal entries: random sub-ranges
    (empty ones included), targets below, inside and above the range, both the >= and
    the > predicate, with `search_rounds` rounds for the longest range."""
    v4 = _v4()
    kernel = _search_kernel
    n_sorted, n_queries, block = 300, 64, 64
    data = torch.cumsum(torch.randint(0, 3, (n_sorted,), generator=gen), 0)
    lo = torch.randint(0, n_sorted + 1, (n_queries,), generator=gen)
    hi = torch.minimum(lo + torch.randint(0, n_sorted + 1, (n_queries,), generator=gen),
                       torch.tensor(n_sorted))  # fmt: skip
    hi[:4] = lo[:4]  # empty ranges
    lo[4:8], hi[4:8] = 0, n_sorted  # the whole array
    target = torch.randint(-2, int(data[-1]) + 3, (n_queries,), generator=gen)
    target[8] = -5  # below everything
    target[9] = int(data[-1]) + 5  # above everything
    rounds = v4.search_rounds(int((hi - lo).max()), fan)
    for strict in (False, True):
        out = torch.empty(n_queries, dtype=torch.int64)
        kernel[(1,)](data, lo, hi, target, out, n_queries, STRICT=strict, ROUNDS=rounds,
                     FAN=fan, BLOCK=block)  # fmt: skip
        for q in range(n_queries):
            a, b = int(lo[q]), int(hi[q])
            want = a + int(torch.searchsorted(data[a:b], target[q], right=strict))
            assert int(out[q]) == want, (strict, q, a, b, int(target[q]))


def test_dispatch_tables_benchmark_smoke(capsys):
    """`benchmarks/dispatch_tables.py --smoke`: every table setting through the
    many-program path matches its torch reference (cumsum, searchsorted) in the
    interpreter; exit status 0 and no mismatch printed."""
    import importlib
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        tables = importlib.import_module("dispatch_tables")
        assert tables.main(["--smoke"]) == 0
    finally:
        sys.path.pop(0)
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "EQUAL" in out
    assert "'mismatches': 0" in out


def test_search_rounds():
    """Each round of a k-ary search over n entries leaves at most ceil(n / fan) - 1."""
    v4 = _v4()
    assert v4.search_rounds(0, 16) == 0
    assert v4.search_rounds(3, 2) == 2
    assert v4.search_rounds(1, 16) == 1
    assert v4.search_rounds(16, 16) == 1
    assert v4.search_rounds(17, 16) == 2
    assert v4.search_rounds(8192, 16) == 4
    assert v4.search_rounds(8192, 2) == 13
    with pytest.raises(ValueError, match="fan"):
        v4.search_rounds(5, 1)


def test_host_int_helpers_match_triton():
    """`common.cdiv` / `next_power_of_2` (plain ints in the launch code) give Triton's
    values, including 0 and values past 2^31."""
    import triton

    from freescale.kernels.common import cdiv, next_power_of_2

    values = [*range(0, 2100), (1 << 31) - 1, 1 << 31, (1 << 31) + 1, (1 << 40) + 7]
    for n in values:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 1024, 4097):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_v4_carve_aligned_views():
    """Scratch views of one allocation: at least the asked sizes, 512-byte aligned starts
    (relative to the allocation, as the caching allocator aligns separate tensors)."""
    v4 = _v4()
    for dtype in (torch.int32, torch.int64):
        views = v4._carve(dtype, torch.device("cpu"), 1, 0, 5, 3, 17)
        assert [v.numel() >= s for v, s in zip(views, (1, 0, 5, 3, 17))] == [True] * 5
        base = views[0].data_ptr()
        assert all(v.dtype == dtype for v in views)
        assert all((v.data_ptr() - base) % 512 == 0 for v in views if v.numel())
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1


def test_v4_empty_inputs():
    v4 = _v4()
    for lengths, blocks in (([0, 0, 0, 0], [3, 4]), ([], [5]), ([], [])):
        for dtype in INDEX_DTYPES:
            got = v4.ranged_dispatch_v4(
                torch.zeros(0, dtype=dtype),
                torch.tensor(lengths, dtype=dtype),
                torch.tensor(blocks, dtype=dtype),
                4,
            )
            assert got.values.numel() == 0 and got.values.dtype == dtype
            assert got.lengths.tolist() == lengths * 4
            assert got.splits.tolist() == [0] * 4
            assert got.key_counts.shape == (4, len(blocks))


@pytest.mark.parametrize("lengths_mode", LENGTHS_MODES)
def test_v4_deterministic(gen, lengths_mode):
    case = random_dispatch_case(gen, 64, max_batch=4, max_len=50, with_weights=True)
    args = (case.values, case.lengths, case.block_sizes, 64)
    knobs = {"weights": case.weights, "tile": 16, "lengths_mode": lengths_mode}
    first = _v4().ranged_dispatch_v4(*args, **knobs)
    assert_dispatch_equal(first, _v4().ranged_dispatch_v4(*args, **knobs), "run twice")


def test_v4_rejects_bad_knobs():
    v4 = _v4()
    args = (torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([4]), 2)
    bad = ({"tile": 48}, {"tile": 8}, {"chunk": 64}, {"scatter_block": 24},
           {"finish_block": 8}, {"finish_block": 512}, {"lengths_mode": "diagonal"},
           {"scatter_order": "random"}, {"peers": "ballot"}, {"et_gather": "smem"},
           {"peers": "match"})  # fmt: skip  # match: PTX, needs CUDA
    for knobs in bad:
        with pytest.raises(ValueError):
            v4.ranged_dispatch_v4(*args, **knobs)
    with pytest.raises(ValueError):
        v4.ranged_dispatch_v4(*args[:3], v4.MAX_WORLD + 1)
    with pytest.raises(ValueError, match="et_gather='row'"):
        v4.ranged_dispatch_v4(*args[:3], v4.ET_ROW_MAX_WORLD + 1, et_gather="row")


def test_v4_default_config():
    v4 = _v4()
    cpu = v4.default_config_v4(8, torch.device("cpu"), 1 << 20)
    assert (cpu.tile, cpu.chunk, cpu.scatter_block, cpu.finish_block) == (64, 16, 32, 16)
    assert (cpu.lengths_mode, cpu.scatter_order, cpu.peers) == ("rows", "tile", "auto")
    assert not v4._use_match(cpu, torch.device("cpu"))  # the interpreter compares
    cuda = torch.device("cuda")
    assert v4.default_config_v4(1024, cuda, 1 << 26).tile == 8192
    assert v4.default_config_v4(8, cuda, 1 << 20).tile == 1024
    assert v4.default_config_v4(8, cuda, 100).tile == 1024
    # the scatter's offset row through tl.gather by default up to the measured W, on
    # both devices
    top = v4.ET_ROW_DEFAULT_MAX_WORLD
    for dev in (torch.device("cpu"), cuda):
        assert v4.default_config_v4(top, dev, 1 << 26).et_gather == "row"
        assert v4.default_config_v4(top + 1, dev, 1 << 26).et_gather == "global"
    # wider scatter programs where they measured faster (W = 128..512) and a tile holds
    # them (8K-id tiles at 2^26 ids; 1K-id tiles below 2^24)
    for w, n, block, warps in ((64, 1 << 26, 1024, 4), (128, 1 << 26, 2048, 8),
                               (512, 1 << 26, 2048, 8), (1024, 1 << 26, 1024, 4),
                               (256, 1 << 22, 1024, 4)):  # fmt: skip
        cfg = v4.default_config_v4(w, cuda, n)
        assert (cfg.scatter_block, cfg.scatter_warps) == (block, warps), (w, n)
    assert v4.default_scatter_warps(2048) == 8 and v4.default_scatter_warps(1024) == 4


def test_v4_et_row_above_the_default_range(gen):
    """et_gather="row" asked for explicitly above ET_ROW_DEFAULT_MAX_WORLD (W=2048, a row
    of 2048 offsets per program), against the reference."""
    case = random_dispatch_case(gen, 2048, max_batch=4, max_len=60, with_weights=True)
    args = (case.values, case.lengths, case.block_sizes, 2048)
    _check(args, "block", case.weights, case.describe(), et_gather="row")


if triton_available():  # a module-level kernel: jit functions resolve names in globals
    import triton
    import triton.language as tl

    from freescale.kernels.triton_dispatch_v4 import _chunk_rank

    @triton.jit
    def _probe_chunk_rank(dest_ptr, earlier_ptr, last_ptr, CHUNK: tl.constexpr):
        lane = tl.arange(0, CHUNK)
        earlier, last = _chunk_rank(tl.load(dest_ptr + lane), CHUNK, False)
        tl.store(earlier_ptr + lane, earlier)
        tl.store(last_ptr + lane, last.to(tl.int32))


def test_v4_chunk_rank(gen):
    """The per-chunk rank and "last lane of its dest" flags directly: the interpreter keeps
    the last of several stores to one address, so only this test notices a counter
    written back by more than one lane (on a GPU that lane would be unspecified)."""
    for chunk in (16, 32):
        for high in (1, 3, chunk, 1 << 20):
            dest = torch.randint(-1, high, (chunk,), generator=gen, dtype=torch.int32)
            earlier = torch.empty(chunk, dtype=torch.int32)
            last = torch.empty(chunk, dtype=torch.int32)
            _probe_chunk_rank[(1,)](dest, earlier, last, CHUNK=chunk)
            d = dest.tolist()
            assert earlier.tolist() == [d[:i].count(x) for i, x in enumerate(d)], d
            assert last.tolist() == [int(x not in d[i + 1 :]) for i, x in enumerate(d)], d


@pytest.mark.parametrize("mode", ["block", "modulo"])
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_env_var_routes_the_dispatcher_to_v4(gen, monkeypatch, world_size, mode):
    """``FREESCALE_TRITON_DISPATCH=v4`` makes `kernels.ranged_dispatch` (what training
    calls) run v4 on the Triton backend — same results as the reference; an unknown
    value is a clear error, not a silent fallback."""
    from freescale.kernels import ranged_dispatch

    case = random_dispatch_case(gen, world_size)
    args = (case.values, case.lengths, case.block_sizes, world_size)
    calls = []
    v4 = _v4()
    real = v4.ranged_dispatch_v4
    monkeypatch.setattr(v4, "ranged_dispatch_v4", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("FREESCALE_TRITON_DISPATCH", "v4")
    got = ranged_dispatch(*args, mode=mode, weights=case.weights, backend="triton")
    assert calls, "the dispatcher did not route to v4"
    ref = reference.ranged_dispatch(*args, mode=mode, weights=case.weights)
    assert_dispatch_equal(ref, got, f"env v4 W={world_size}")
    monkeypatch.setenv("FREESCALE_TRITON_DISPATCH", "v6")
    with pytest.raises(ValueError, match="FREESCALE_TRITON_DISPATCH"):
        ranged_dispatch(*args, mode=mode, backend="triton")


def test_v5_request_runs_v4_where_v5_cannot(gen, monkeypatch):
    """``FREESCALE_TRITON_DISPATCH=v5`` (the Gluon dispatch, GPU only): in the
    interpreter, with weights, past W = 4096 or on a GPU other than sm_90 the call runs v4
    (same bits as the reference); on a compiled sm_90 CUDA call v5 is chosen (decided
    from the device, no GPU needed for the choice)."""
    import importlib
    import types

    from freescale.kernels import ops, ranged_dispatch

    # imported (its plain Triton kernels decorated) while TRITON_INTERPRET=1, before the
    # environment changes below: a later test runs them in the interpreter
    importlib.import_module("freescale.kernels.triton_dispatch_v5")

    case = random_dispatch_case(gen, 8, with_weights=True)
    args = (case.values, case.lengths, case.block_sizes, 8)
    calls = []
    v4 = _v4()
    real = v4.ranged_dispatch_v4
    monkeypatch.setattr(v4, "ranged_dispatch_v4", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("FREESCALE_TRITON_DISPATCH", "v5")
    got = ranged_dispatch(*args, weights=case.weights, backend="triton")
    assert calls, "v5 requested in the interpreter: v4 should have run"
    assert_dispatch_equal(reference.ranged_dispatch(*args, weights=case.weights), got, "v5->v4")
    cuda_call = types.SimpleNamespace(device=torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(ops, "_cuda_capability", lambda device: (9, 0))
    for card in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):  # v5's two default tables
        monkeypatch.setattr(ops, "_cuda_name", lambda device, c=card: c)
        assert ops._v5_runs(cuda_call, 1024, None)
        assert ops._v5_runs(cuda_call, ops.V5_MAX_WORLD, None)
    for other in ((8, 0), (10, 0), (12, 0)):  # not the H100/H200 it was checked on
        monkeypatch.setattr(ops, "_cuda_capability", lambda device, c=other: c)
        assert not ops._v5_runs(cuda_call, 1024, None), other
    monkeypatch.setattr(ops, "_cuda_capability", lambda device: (9, 0))
    assert not ops._v5_runs(cuda_call, 1024, torch.ones(1))  # weights
    assert not ops._v5_runs(cuda_call, 5000, None)  # W > 4096
    assert not ops._v5_runs(case.values, 8, None)  # CPU
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not ops._v5_runs(cuda_call, 8, None)


def test_auto_dispatches_large_calls_with_v4(gen, monkeypatch):
    """Without ``$FREESCALE_TRITON_DISPATCH`` the Triton backend runs v3 below
    `ops.V4_MIN_IDS` ids per call and v4 from there (the threshold lowered to this input's
    size here); results equal the reference either way."""
    from freescale.kernels import ops, ranged_dispatch, triton_impl

    monkeypatch.delenv("FREESCALE_TRITON_DISPATCH", raising=False)
    case = random_dispatch_case(gen, 8, max_batch=6, max_len=40, with_weights=True)
    args = (case.values, case.lengths, case.block_sizes, 8)
    n = case.values.numel()
    calls: list[str] = []
    v4 = _v4()
    real_v4, real_v3 = v4.ranged_dispatch_v4, triton_impl.ranged_dispatch_v1
    monkeypatch.setattr(
        v4, "ranged_dispatch_v4", lambda *a, **k: calls.append("v4") or real_v4(*a, **k)
    )
    monkeypatch.setattr(
        triton_impl, "ranged_dispatch_v1", lambda *a, **k: calls.append("v3") or real_v3(*a, **k)
    )
    ref = reference.ranged_dispatch(*args, weights=case.weights)
    for threshold, expected in ((n + 1, "v3"), (n, "v4")):
        monkeypatch.setattr(ops, "V4_MIN_IDS", threshold)
        assert ops.triton_dispatch_version(n) == expected
        got = ranged_dispatch(*args, weights=case.weights, backend="triton")
        assert calls[-1] == expected, (threshold, calls)
        assert_dispatch_equal(ref, got, f"auto, threshold {threshold}")
    monkeypatch.setenv("FREESCALE_TRITON_DISPATCH", "v3")
    assert ops.triton_dispatch_version(1 << 40) == "v3"  # an explicit choice wins


def test_auto_asks_for_v5_on_large_calls(gen, monkeypatch):
    """ "auto" asks for v5 from `ops.V5_MIN_IDS` ids (lowered to this input's size here):
    on a compiled sm_90 CUDA call `ranged_dispatch` runs v5 (the call is intercepted: no
    GPU here), in the interpreter v4 runs; a weighted call stays on v4. Results equal
    the reference on every path that runs."""
    import importlib

    from freescale.kernels import ops, ranged_dispatch

    v5 = importlib.import_module("freescale.kernels.triton_dispatch_v5")
    assert ops.V5_MAX_WORLD == v5.V5_MAX_WORLD
    monkeypatch.delenv("FREESCALE_TRITON_DISPATCH", raising=False)
    case = random_dispatch_case(gen, 8, max_batch=6, max_len=40, with_weights=True)
    while case.values.numel() == 0:  # an empty call is below V4_MIN_IDS: v3's
        case = random_dispatch_case(gen, 8, max_batch=6, max_len=40, with_weights=True)
    args = (case.values, case.lengths, case.block_sizes, 8)
    n = case.values.numel()
    monkeypatch.setattr(ops, "V5_MIN_IDS", n)
    assert ops.triton_dispatch_version(n, 8) == "v5"
    calls: list[str] = []
    v4 = _v4()
    real_v4 = v4.ranged_dispatch_v4
    monkeypatch.setattr(
        v4, "ranged_dispatch_v4", lambda *a, **k: calls.append("v4") or real_v4(*a, **k)
    )
    ref = reference.ranged_dispatch(*args)
    assert_dispatch_equal(ref, ranged_dispatch(*args, backend="triton"), "auto v5 -> v4")
    assert calls == ["v4"], calls  # the interpreter: v5 cannot run, v4 did
    ref_w = reference.ranged_dispatch(*args, weights=case.weights)
    got_w = ranged_dispatch(*args, weights=case.weights, backend="triton")
    assert_dispatch_equal(ref_w, got_w, "auto weighted")
    assert calls == ["v4", "v4"], calls
    # a compiled sm_90 call: v5 is what runs (intercepted before it would need a GPU)
    monkeypatch.setattr(ops, "_v5_runs", lambda values, world, weights: weights is None)
    monkeypatch.setattr(
        v5, "ranged_dispatch_v5", lambda *a, **k: calls.append("v5") or real_v4(*a, **k)
    )
    ranged_dispatch(*args, backend="triton")
    assert calls[-1] == "v5", calls
    ranged_dispatch(*args, weights=case.weights, backend="triton")
    assert calls[-1] == "v4", calls
    ranged_dispatch(*args[:3], ops.V5_MAX_WORLD + 1, backend="triton")
    assert calls[-1] == "v4", calls


def test_match_path_only_where_it_compiles(monkeypatch):
    """`V4Config.peers`: the PTX path is chosen only for compiled kernels on an NVIDIA
    device with 32-id chunks; the interpreter (also with CUDA tensors) compares; asking
    for "match" where it cannot run is a clear error. No GPU needed: only the choice."""
    v4 = _v4()
    cuda = torch.device("cuda")
    cfg = v4.V4Config(tile=1024)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert v4._use_match(cfg, cuda)
    assert not v4._use_match(v4.V4Config(tile=1024, peers="compare"), cuda)
    assert not v4._use_match(v4.V4Config(tile=1024, chunk=16), cuda)
    assert not v4._use_match(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match="chunk 32"):
        v4._use_match(v4.V4Config(tile=1024, chunk=16, peers="match"), cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not v4._use_match(cfg, cuda)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        v4._use_match(v4.V4Config(tile=1024, peers="match"), cuda)


def test_dispatch_version_rule(monkeypatch):
    """Unset, empty or "auto": v4 from `ops.V4_MIN_IDS` ids when v4 can take the world
    size, else v3; an explicit version is obeyed; anything else is an error."""
    from freescale.kernels import ops

    big, huge = ops.V4_MIN_IDS, ops.V5_MIN_IDS
    assert ops.V4_MAX_WORLD == _v4().MAX_WORLD
    assert big < huge
    for value in (None, "", "auto"):
        if value is None:
            monkeypatch.delenv("FREESCALE_TRITON_DISPATCH", raising=False)
        else:
            monkeypatch.setenv("FREESCALE_TRITON_DISPATCH", value)
        assert ops.triton_dispatch_version(big - 1, 8) == "v3"
        assert ops.triton_dispatch_version(big, 8) == "v4"
        assert ops.triton_dispatch_version(big, ops.V4_MAX_WORLD) == "v4"
        assert ops.triton_dispatch_version(big, ops.V4_MAX_WORLD + 1) == "v3"
        # v5 from V5_MIN_IDS on unweighted calls it can take; v4 / v3 otherwise
        assert ops.triton_dispatch_version(huge - 1, 8) == "v4"
        assert ops.triton_dispatch_version(huge, 8) == "v5"
        assert ops.triton_dispatch_version(huge, ops.V5_MAX_WORLD) == "v5"
        assert ops.triton_dispatch_version(huge, 8, weighted=True) == "v4"
        assert ops.triton_dispatch_version(huge, ops.V5_MAX_WORLD + 1) == "v4"
        assert ops.triton_dispatch_version(huge, ops.V4_MAX_WORLD + 1) == "v3"
    for forced in ("v1", "v2", "v3", "v4", "v5"):
        monkeypatch.setenv("FREESCALE_TRITON_DISPATCH", forced)
        assert ops.triton_dispatch_version(5, 2) == forced
    monkeypatch.setenv("FREESCALE_TRITON_DISPATCH", "V4")
    with pytest.raises(ValueError, match="FREESCALE_TRITON_DISPATCH"):
        ops.triton_dispatch_version(5, 2)


if triton_available():
    import triton
    import triton.language as tl

    from freescale.kernels import triton_dispatch_v4 as _v4_mod

    @triton.jit
    def _owner_probe(ids_ptr, out_ptr, blk_ptr, n, WORLD: tl.constexpr, MODULO: tl.constexpr,
                     EXACT: tl.constexpr, B: tl.constexpr):  # fmt: skip
        """out = v4's `_owner` (or `owner_exact`) of ids, looked up on the module at run
        time (the interpreter), so that a test can swap it."""
        offs = tl.arange(0, B)
        m = offs < n
        ids = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int64)
        blk = tl.load(blk_ptr).to(tl.int64)
        if EXACT:
            owner = _v4_mod.owner_exact(ids, blk, WORLD, MODULO)
        else:
            owner = _v4_mod._owner(ids, blk, WORLD, MODULO)
        tl.store(out_ptr + offs, owner, mask=m)

    @triton.jit
    def _narrow_probe(ids_ptr, owner_ptr, local_ptr, ok_ptr, blk_ptr, n, WORLD: tl.constexpr,
                      B: tl.constexpr):  # fmt: skip
        """owner, local = v4's `owner_local_narrow` of ids (looked up on the module at run
        time, so that a test can swap it); ok = `narrow_ok` of the block size."""
        offs = tl.arange(0, B)
        m = offs < n
        ids = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int64)
        blk = tl.load(blk_ptr).to(tl.int64)
        owner, local = _v4_mod.owner_local_narrow(ids, blk, 1.0 / blk.to(tl.float32), WORLD)
        tl.store(owner_ptr + offs, owner, mask=m)
        tl.store(local_ptr + offs, local, mask=m)
        tl.store(ok_ptr, _v4_mod.narrow_ok(blk, WORLD).to(tl.int32))

    @triton.jit
    def _narrow_low_compare(ids, blk, inv, WORLD: tl.constexpr):
        """A mutation: the range check on the low word only (ids past 2^32 whose low word
        is in range would take the 32-bit result)."""
        blk32 = blk.to(tl.int32)
        lo = ids.to(tl.int32)
        q = tl.minimum(lo.to(tl.float32) * inv, WORLD * 1.0).to(tl.int32)
        r = lo - q * blk32
        neg = r < 0
        big = r >= blk32
        q = tl.where(neg, q - 1, tl.where(big, q + 1, q))
        r = tl.where(neg, r + blk32, tl.where(big, r - blk32, r))
        inside = (lo >= 0) & (lo < blk32 * WORLD)
        owner = tl.where(inside, q, _v4_mod.umod(ids, WORLD).to(tl.int32))
        local = tl.where(inside, r.to(tl.int64), _v4_mod.udiv(ids, WORLD))
        return owner, local

    @triton.jit
    def _narrow_uncorrected(ids, blk, inv, WORLD: tl.constexpr):
        """A mutation: the 32-bit estimate without its correction."""
        blk32 = blk.to(tl.int32)
        lo = ids.to(tl.int32)
        q = tl.minimum(lo.to(tl.float32) * inv, WORLD * 1.0).to(tl.int32)
        inside = ids < blk * WORLD
        owner = tl.where(inside, q, _v4_mod.umod(ids, WORLD).to(tl.int32))
        local = tl.where(inside, (lo - q * blk32).to(tl.int64), _v4_mod.udiv(ids, WORLD))
        return owner, local

    @triton.jit
    def _owner_uncorrected(ids, blk, WORLD: tl.constexpr, MODULO: tl.constexpr):
        """The mutation: `_owner`'s float estimate without its correction."""
        est = tl.minimum(ids.to(tl.float32) * (1.0 / blk.to(tl.float32)), WORLD * 1.0)
        return tl.where(ids < blk * WORLD, est.to(tl.int32), (ids % WORLD).to(tl.int32))


def _owner_cases(gen) -> list[tuple[int, int, torch.Tensor]]:
    """(world, blk, ids): ids at every block border +-1, random ids below and above
    blk * world, and ids near 2^62 (the float estimate's largest relative error)."""
    cases = []
    for world, blk in ((1, 5), (3, 7), (1000, 1), (1024, 977), (4096, 1 << 40), (32767, 3),
                       (7, (1 << 59) + 12345), (1024, 65537)):  # fmt: skip
        borders = torch.arange(world + 1, dtype=torch.int64) * blk
        ids = torch.cat([borders - 1, borders, borders + 1]).clamp(min=0)
        top = blk * world
        rnd = (torch.rand(512, generator=gen, dtype=torch.float64) * top).long()
        past = top + torch.randint(0, 1 << 30, (64,), generator=gen)
        cases.append((world, blk, torch.cat([ids, rnd, past.clamp(max=(1 << 63) - 1)])))
    return cases


@pytest.mark.parametrize("mode", ["block", "modulo"])
def test_owner_without_division_is_exact(gen, mode):
    """v4/v5's `_owner` (float estimate + one exact correction, no 64-bit division) gives
    `reference.owner_and_local`'s owners on border and random ids; the plain rule
    `owner_exact` agrees; and an estimate without the correction is caught (the check can
    fail)."""
    modulo = mode == "modulo"

    def run(ids, world, blk, exact):
        out = torch.empty(ids.numel(), dtype=torch.int32)
        n, blocks = ids.numel(), torch.tensor([blk])
        _owner_probe[(1,)](ids, out, blocks, n, WORLD=world, MODULO=modulo, EXACT=exact,
                           B=triton.next_power_of_2(n))  # fmt: skip
        return out.long()

    caught = 0
    for world, blk, ids in _owner_cases(gen):
        keys = torch.zeros(ids.numel(), dtype=torch.int64)
        want, _ = reference.owner_and_local(ids, keys, torch.tensor([blk]), world, mode)
        assert torch.equal(run(ids, world, blk, False), want), (world, blk, mode)
        assert torch.equal(run(ids, world, blk, True), want), (world, blk, mode)
        if not modulo:
            saved = _v4_mod._owner
            try:
                _v4_mod._owner = _owner_uncorrected
                caught += not torch.equal(run(ids, world, blk, False), want)
            finally:
                _v4_mod._owner = saved
    assert modulo or caught > 0, "the uncorrected estimate was never wrong: the cases are too easy"


def _narrow_limit_blk(world: int) -> int:
    """The largest block size `narrow_ok` accepts at this world size."""
    return (2**31 - 1) // (world + 1)


@pytest.mark.parametrize("mutation", [None, "low_compare", "uncorrected"])
def test_owner_local_narrow_is_exact(gen, mutation):
    """Block mode's 32-bit owner and local row (`owner_local_narrow`, v5's ``narrow``
    option) equal `reference.owner_and_local` wherever `narrow_ok` holds: ids at every
    block border +-1, random ids below blk * W, ids past it up to 2^63 - 1, and ids past
    2^32 whose low word lies in range; `narrow_ok` is true up to the largest admissible
    block size and false one above. Each mutation (a range check on the low word only, an
    estimate without its correction) is caught."""
    v4 = _v4()
    cases = []
    pairs = [(1, 5), (3, 7), (1000, 1), (1024, 977), (32767, 3), (7, 65537)]
    pairs += [(w, _narrow_limit_blk(w)) for w in (1, 1024, 4096)]
    pairs += [(100, _narrow_limit_blk(100) - 17)]
    for world, blk in pairs:
        top = blk * world
        borders = torch.arange(world + 1, dtype=torch.int64) * blk
        below = (torch.rand(512, generator=gen, dtype=torch.float64) * top).long()
        past = top + torch.randint(0, 1 << 30, (64,), generator=gen)
        far = torch.randint(0, 1 << 62, (64,), generator=gen) * 2 + 1
        high = (torch.randint(1, 1 << 20, (64,), generator=gen) << 32) + below[:64]
        edges = torch.tensor([2**63 - 1, 2**32, 2**32 - 1, 2**31, 2**31 - 1])
        ids = torch.cat([borders - 1, borders, borders + 1, below, past, far, high, edges])
        cases.append((world, blk, ids.clamp(min=0)))
    saved = v4.owner_local_narrow
    wrong = 0
    try:
        if mutation == "low_compare":
            v4.owner_local_narrow = _narrow_low_compare
        elif mutation == "uncorrected":
            v4.owner_local_narrow = _narrow_uncorrected
        for world, blk, ids in cases:
            n = ids.numel()
            owner = torch.empty(n, dtype=torch.int32)
            local = torch.empty(n, dtype=torch.int64)
            ok = torch.zeros(1, dtype=torch.int32)
            _narrow_probe[(1,)](ids, owner, local, ok, torch.tensor([blk]), n, WORLD=world,
                                B=triton.next_power_of_2(n))  # fmt: skip
            assert ok.item() == 1, (world, blk)
            keys = torch.zeros(n, dtype=torch.int64)
            want_owner, want_local = reference.owner_and_local(
                ids, keys, torch.tensor([blk]), world, "block"
            )
            same = torch.equal(owner.long(), want_owner) and torch.equal(local, want_local)
            if mutation is None:
                assert same, (world, blk)
            wrong += not same
        for world in (1, 1024, 4096):
            ok = torch.zeros(1, dtype=torch.int32)
            blk = _narrow_limit_blk(world) + 1
            one = torch.zeros(1, dtype=torch.int64)
            _narrow_probe[(1,)](one, torch.empty(1, dtype=torch.int32), one.clone(), ok,
                                torch.tensor([blk]), 1, WORLD=world, B=2)  # fmt: skip
            assert ok.item() == 0, (world, blk)
    finally:
        v4.owner_local_narrow = saved
    if mutation is not None:
        assert wrong > 0, f"the mutation {mutation!r} was not caught"
