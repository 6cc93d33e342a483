"""Jagged index kernels: every backend against the reference, the reference against fbgemm.

Fresh random inputs each run; each test prints its seed (shown by pytest on failure;
replay with FREESCALE_TEST_SEED=<seed>). Triton runs in interpreter mode on CPU, so its
cases are small. fbgemm is optional: tests that need it skip with the reason.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_impl is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from freescale.kernels import (  # noqa: E402
    BACKEND_ENV_VAR,
    indexed_permute,
    keyed_transpose,
    naive,
    ranged_combine,
    ranged_combine_backward,
    ranged_dispatch,
    reference,
    vectorized,
)
from freescale.kernels.common import resolve_backend, triton_available  # noqa: E402

try:
    from _kernel_cases import (
        SEED_ENV_VAR,
        assert_dispatch_equal,
        fresh_seed,
        oracle_dispatch,
        random_dispatch_case,
        random_permute_case,
    )
except ImportError:  # tests/ imported as a package
    from tests._kernel_cases import (
        SEED_ENV_VAR,
        assert_dispatch_equal,
        fresh_seed,
        oracle_dispatch,
        random_dispatch_case,
        random_permute_case,
    )

torch.set_num_threads(1)

try:
    import fbgemm_gpu  # noqa: F401

    HAVE_FBGEMM = hasattr(torch.ops.fbgemm, "block_bucketize_sparse_features")
except Exception:  # noqa: BLE001 - any import failure means "no fbgemm here"
    HAVE_FBGEMM = False

needs_fbgemm = pytest.mark.skipif(
    not HAVE_FBGEMM, reason="fbgemm_gpu not installed (GPU machines have none); oracle tests"
)
needs_triton = pytest.mark.skipif(
    not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton missing, or TRITON_INTERPRET was not 1 when this module was imported",
)

INDEX_DTYPES = [torch.int32, torch.int64]
WORLD_SIZES = [1, 2, 3, 7, 8, 64, 1024]


@pytest.fixture
def gen() -> torch.Generator:
    seed = fresh_seed()
    print(f"seed={seed} (replay with {SEED_ENV_VAR}={seed})")
    return torch.Generator().manual_seed(seed)


def _triton():
    from freescale.kernels import triton_impl

    return triton_impl


def _dtypes(i: int) -> dict:
    return {"values_dtype": INDEX_DTYPES[i % 2], "lengths_dtype": INDEX_DTYPES[(i // 2) % 2]}


# ----------------------------------------------------------------- ranged dispatch


@needs_fbgemm
def test_dispatch_reference_matches_fbgemm(gen):
    op = torch.ops.fbgemm.block_bucketize_sparse_features
    for i in range(60):
        world = WORLD_SIZES[i % len(WORLD_SIZES)]
        case = random_dispatch_case(gen, world, with_weights=i % 3 == 0, **_dtypes(i))
        got = reference.ranged_dispatch(
            case.values, case.lengths, case.block_sizes, world, weights=case.weights
        )
        new_lengths, new_values, new_weights, _, permute = op(
            case.lengths, case.values, False, True, case.block_sizes, world, case.weights
        )
        ctx = case.describe()
        assert got.lengths.dtype == new_lengths.dtype and torch.equal(got.lengths, new_lengths), ctx
        assert got.values.dtype == new_values.dtype and torch.equal(got.values, new_values), ctx
        assert torch.equal(got.unbucketize_permute, permute.to(torch.int64)), ctx
        if case.weights is not None:
            assert torch.equal(got.weights, new_weights), ctx


@pytest.mark.parametrize("mode", ["block", "modulo"])
def test_dispatch_reference_matches_oracle(gen, mode):
    for i in range(40):
        world = WORLD_SIZES[i % len(WORLD_SIZES)]
        case = random_dispatch_case(gen, world, **_dtypes(i))
        got = reference.ranged_dispatch(
            case.values, case.lengths, case.block_sizes, world, mode=mode
        )
        values, lengths, permute = oracle_dispatch(
            case.values, case.lengths, case.block_sizes, world, mode
        )
        ctx = case.describe()
        assert got.values.tolist() == values, ctx
        assert got.lengths.tolist() == lengths, ctx
        assert got.unbucketize_permute.tolist() == permute, ctx
        per_dest = got.lengths.view(world, -1).sum(1)
        assert torch.equal(got.splits, per_dest), ctx
        assert got.key_counts.shape == (world, case.block_sizes.numel()), ctx
        assert torch.equal(got.key_counts.sum(1), got.splits), ctx


def test_dispatch_reference_counts_past_bincount_limit(gen, monkeypatch):
    """Past `reference.BINCOUNT_MAX_BINS` output segments (W x segments; torch.bincount
    crashed on CUDA at 2.4e9 bins) the reference counts with index_put_: the same
    lengths, splits and key counts as the oracle (limit lowered to 0 here)."""
    monkeypatch.setattr(reference, "BINCOUNT_MAX_BINS", 0)
    for i in range(12):
        world = WORLD_SIZES[i % len(WORLD_SIZES)]
        case = random_dispatch_case(gen, world, **_dtypes(i))
        got = reference.ranged_dispatch(case.values, case.lengths, case.block_sizes, world)
        _, lengths, _ = oracle_dispatch(case.values, case.lengths, case.block_sizes, world, "block")
        assert got.lengths.tolist() == lengths, case.describe()
        assert torch.equal(got.splits, got.lengths.view(world, -1).sum(1).to(torch.int64))


@pytest.mark.parametrize("impl", [vectorized, naive], ids=["vectorized", "naive"])
@pytest.mark.parametrize("mode", ["block", "modulo"])
def test_dispatch_baselines_match_reference(gen, impl, mode):
    for i in range(30):
        world = WORLD_SIZES[i % len(WORLD_SIZES)]
        case = random_dispatch_case(gen, world, with_weights=i % 2 == 0, **_dtypes(i))
        args = (case.values, case.lengths, case.block_sizes, world)
        expected = reference.ranged_dispatch(*args, mode=mode, weights=case.weights)
        actual = impl.ranged_dispatch(*args, mode=mode, weights=case.weights)
        assert_dispatch_equal(expected, actual, case.describe())


@needs_triton
@pytest.mark.parametrize("world", [1, 3, 8, 1024])
@pytest.mark.parametrize("mode", ["block", "modulo"])
@pytest.mark.parametrize(
    "dest_major,head_load", [(False, False), (True, False), (True, True)], ids=["v1", "v3", "v3h"]
)
def test_dispatch_triton_v1_matches_reference(gen, world, mode, dest_major, head_load):
    triton_impl = _triton()
    for i, tile in enumerate((16, None, 64)):  # 16: segments span several tiles
        case = random_dispatch_case(
            gen, world, max_batch=8, max_len=70, with_weights=i != 1, **_dtypes(world + i)
        )
        args = (case.values, case.lengths, case.block_sizes, world)
        expected = reference.ranged_dispatch(*args, mode=mode, weights=case.weights)
        actual = triton_impl.ranged_dispatch_v1(
            *args, mode=mode, weights=case.weights, tile=tile, dest_major=dest_major,
            head_load=head_load,
        )  # fmt: skip
        assert_dispatch_equal(expected, actual, f"tile={tile} {case.describe()}")


@needs_triton
def test_dispatch_v3_segment_table_fallback(gen, monkeypatch):
    """Batches with more segments than one program scans take torch's scans instead of
    the fused segment-table kernel: same result."""
    triton_impl = _triton()
    monkeypatch.setattr(triton_impl, "_SEGMENT_TABLE_MAX", 4)
    for world in (3, 64):
        case = random_dispatch_case(gen, world, max_batch=8, max_len=70, **_dtypes(world))
        args = (case.values, case.lengths, case.block_sizes, world)
        expected = reference.ranged_dispatch(*args)
        actual = triton_impl.ranged_dispatch_v1(*args, tile=16, dest_major=True)
        assert_dispatch_equal(expected, actual, case.describe())


# (chunk, block): None = the CPU default (32, 16); segments of up to 70 ids span several
# chunks, chunks span several blocks, and block == chunk is covered too.
CHUNK_BLOCKS = [(16, 16), (None, None), (64, 16), (32, 32)]


@needs_triton
@pytest.mark.parametrize("world", [1, 3, 8, 1024])
@pytest.mark.parametrize("mode", ["block", "modulo"])
def test_dispatch_triton_matches_reference(gen, world, mode):
    triton_impl = _triton()
    for i, (chunk, block) in enumerate(CHUNK_BLOCKS):
        case = random_dispatch_case(
            gen, world, max_batch=8, max_len=70, with_weights=i % 2 == 0, **_dtypes(world + i)
        )
        args = (case.values, case.lengths, case.block_sizes, world)
        expected = reference.ranged_dispatch(*args, mode=mode, weights=case.weights)
        actual = triton_impl.ranged_dispatch(
            *args, mode=mode, weights=case.weights, chunk=chunk, block=block
        )
        assert_dispatch_equal(expected, actual, f"chunk={chunk}/{block} {case.describe()}")


def _fixed_dispatch_case(lengths: list[int], ids: torch.Tensor, blocks: list[int], dtypes):
    values_dtype, lengths_dtype = dtypes
    return (
        ids.to(values_dtype),
        torch.tensor(lengths, dtype=lengths_dtype),
        torch.tensor(blocks, dtype=values_dtype),
    )


@needs_triton
@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int64), (torch.int64, torch.int32)])
def test_dispatch_triton_edge_cases(gen, dtypes):
    """Long segments over many chunks, W=1024 with few ids, one dest, empty segments."""
    triton_impl = _triton()
    # K=2, B=3: a 150-id segment (> 4 chunks of 32, > 9 blocks of 16), empty segments.
    lengths = [0, 150, 3, 0, 0, 41]
    n = sum(lengths)
    cases = [
        (4, torch.randint(0, 40, (n,), generator=gen), [10, 10]),  # random dests
        (4, torch.full((n,), 7), [3, 3]),  # every id to dest 2 (7 // 3)
        (4, torch.arange(n) % 3, [1, 1]),  # dests 0..2 interleaved, W=4: dest 3 empty
        (1024, torch.randint(0, 5000, (n,), generator=gen), [5, 5]),  # ids past blk*W too
    ]
    for world, ids, blocks in cases:
        args = (*_fixed_dispatch_case(lengths, ids, blocks, dtypes), world)
        weights = torch.rand(n, generator=gen)
        for mode in ("block", "modulo"):
            expected = reference.ranged_dispatch(*args, mode=mode, weights=weights)
            for chunk, block in CHUNK_BLOCKS[:3]:
                actual = triton_impl.ranged_dispatch(
                    *args, mode=mode, weights=weights, chunk=chunk, block=block
                )
                assert_dispatch_equal(expected, actual, f"W={world} {mode} {chunk}/{block}")
    # W=1024, a handful of ids, all but one segment empty.
    args = (*_fixed_dispatch_case([0, 0, 5, 0], torch.tensor([0, 1023, 5, 1024, 99]), [1, 1],
                                  dtypes), 1024)  # fmt: skip
    expected = reference.ranged_dispatch(*args)
    assert_dispatch_equal(expected, triton_impl.ranged_dispatch(*args), "W=1024 few ids")
    with pytest.raises(ValueError):
        triton_impl.ranged_dispatch(*args, chunk=16, block=32)
    with pytest.raises(ValueError):
        triton_impl.ranged_dispatch(*args, chunk=48)


def test_dispatch_vectorized_large(gen):
    for world in (64, 1024):
        case = random_dispatch_case(gen, world, max_keys=4, max_batch=64, max_len=400)
        args = (case.values, case.lengths, case.block_sizes, world)
        expected = reference.ranged_dispatch(*args)
        assert_dispatch_equal(expected, vectorized.ranged_dispatch(*args), case.describe())


@needs_triton
def test_dispatch_forced_triton_through_dispatcher(gen, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    case = random_dispatch_case(gen, 5, max_len=20, values_dtype=torch.int32)
    args = (case.values, case.lengths, case.block_sizes, 5)
    assert_dispatch_equal(reference.ranged_dispatch(*args), ranged_dispatch(*args), "env")
    monkeypatch.delenv(BACKEND_ENV_VAR)
    got = ranged_dispatch(*args, backend="triton")
    assert_dispatch_equal(reference.ranged_dispatch(*args), got, "arg")


@pytest.mark.parametrize("backend", ["reference", "vectorized", "triton"])
def test_dispatch_empty_inputs(backend):
    if backend == "triton" and (not triton_available() or os.environ["TRITON_INTERPRET"] != "1"):
        pytest.skip("triton interpreter unavailable")
    for lengths, blocks in (([0, 0, 0, 0], [3, 4]), ([], [5]), ([], [])):
        for dtype in INDEX_DTYPES:
            got = ranged_dispatch(
                torch.zeros(0, dtype=dtype),
                torch.tensor(lengths, dtype=dtype),
                torch.tensor(blocks, dtype=dtype),
                4,
                backend=backend,
            )
            assert got.values.numel() == 0 and got.values.dtype == dtype
            assert got.lengths.tolist() == lengths * 4
            assert got.splits.tolist() == [0] * 4
            assert got.key_counts.shape == (4, len(blocks))


def test_dispatch_rejects_bad_arguments():
    ids, lens, blocks = torch.zeros(2, dtype=torch.int64), torch.tensor([1, 1]), torch.tensor([4])
    with pytest.raises(ValueError):
        ranged_dispatch(ids, lens, blocks, 0)
    with pytest.raises(ValueError):
        ranged_dispatch(ids, lens, blocks, 2, mode="cyclic")
    with pytest.raises(TypeError):
        ranged_dispatch(ids.float(), lens, blocks, 2)
    with pytest.raises(ValueError):
        ranged_dispatch(ids, torch.tensor([1, 1, 0]), torch.tensor([4, 4]), 2)


# ----------------------------------------------------------------- ranged combine

COMBINE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _combine_backends():
    backends = ["reference", "vectorized"]
    if triton_available() and os.environ.get("TRITON_INTERPRET") == "1":
        backends.append("triton")
    return backends


@pytest.mark.parametrize("dtype", COMBINE_DTYPES)
def test_combine_backends_match_reference(gen, dtype):
    for width in (1, 33, 300):
        case = random_dispatch_case(gen, 4, max_len=20)
        result = reference.ranged_dispatch(case.values, case.lengths, case.block_sizes, 4)
        perm, n = result.unbucketize_permute, case.values.numel()
        rows = torch.randn(n, width, generator=gen).to(dtype)
        fwd = rows[torch.argsort(perm)] if n else rows  # shard-major -> batch-major is rows
        splits = result.splits.tolist()
        for backend in _combine_backends():
            out = ranged_combine(fwd, perm, backend=backend)
            assert out.dtype == dtype and torch.equal(out, rows), (backend, width)
            back = ranged_combine_backward(rows, perm, backend=backend)
            assert torch.equal(back, fwd), (backend, width)
        assert torch.equal(naive.ranged_combine(fwd, perm, splits), rows)
        assert torch.equal(naive.ranged_combine_backward(rows, perm, splits), fwd)


@pytest.mark.parametrize("backend", _combine_backends())
def test_combine_autograd_is_the_backward_op(gen, backend):
    n, width = 57, 16
    perm = torch.randperm(n, generator=gen)
    rows = torch.randn(n, width, generator=gen, requires_grad=True)
    grad = torch.randn(n, width, generator=gen)
    ranged_combine(rows, perm, backend=backend).backward(grad)
    assert torch.equal(rows.grad, reference.ranged_combine_backward(grad, perm))


# ----------------------------------------------------------------- indexed permute


@needs_fbgemm
def test_permute_reference_matches_fbgemm(gen):
    for i in range(40):
        permute, lengths, values, weights = random_permute_case(gen, **_dtypes(i))
        w = weights if i % 2 else None
        expected = torch.ops.fbgemm.permute_2D_sparse_data(permute, lengths, values, w)
        actual = reference.indexed_permute(permute, lengths, values, w)
        for e, a in zip(expected, actual):
            assert (e is None and a is None) or (e.dtype == a.dtype and torch.equal(e, a))


@pytest.mark.parametrize("backend", ["vectorized", "triton", "naive"])
def test_permute_backends_match_reference(gen, backend):
    if backend == "triton" and not (triton_available() and os.environ["TRITON_INTERPRET"] == "1"):
        pytest.skip("triton interpreter unavailable")
    for i in range(12):
        permute, lengths, values, weights = random_permute_case(gen, **_dtypes(i))
        w = weights if i % 2 else None
        expected = reference.indexed_permute(permute, lengths, values, w)
        if backend == "naive":
            actual = naive.indexed_permute(permute, lengths, values, w)
        else:
            size = int(expected[0].sum()) if i % 3 == 0 else None
            actual = indexed_permute(
                permute, lengths, values, w, permuted_lengths_sum=size, backend=backend
            )
        for e, a in zip(expected, actual):
            assert (e is None and a is None) or (e.dtype == a.dtype and torch.equal(e, a)), i


@pytest.mark.parametrize("backend", ["reference", "vectorized", "triton"])
def test_gather_blocks_with_host_offsets(gen, backend):
    """`ops.gather_blocks` (prioritized's mask exchange on CUDA: one launch with the output
    offsets computed on the host) against the loop it stands for, on random blocks
    (empty ones, overlapping and out-of-order starts, uint8 / int64 / float x), with and
    without the offsets."""
    from freescale.kernels.ops import gather_blocks

    if backend == "triton" and not (triton_available() and os.environ["TRITON_INTERPRET"] == "1"):
        pytest.skip("triton interpreter unavailable")
    for i, dtype in enumerate((torch.uint8, torch.int64, torch.float32) * 2):
        n = int(torch.randint(1, 300, (1,), generator=gen))
        x = (torch.rand(n, generator=gen) * 200).to(dtype)
        k = int(torch.randint(1, 12, (1,), generator=gen))
        starts = torch.randint(0, n, (k,), generator=gen)
        sizes = (torch.rand(k, generator=gen) * (n - starts)).long()
        sizes[torch.rand(k, generator=gen) < 0.25] = 0
        expected = torch.cat([x[a : a + b] for a, b in zip(starts.tolist(), sizes.tolist())])
        offsets = reference.exclusive_cumsum(sizes) if i % 2 else None
        got = gather_blocks(x, starts, sizes, int(sizes.sum()), out_offsets=offsets,
                            backend=backend)  # fmt: skip
        assert got.dtype == dtype and torch.equal(got, expected), (i, backend)
    with pytest.raises(ValueError, match="1-D"):
        gather_blocks(torch.zeros(2, 2), torch.zeros(1).long(), torch.ones(1).long(), 1)


# ----------------------------------------------------------------- keyed transpose


def _fixed_transpose_case(gen, dtype=torch.int64):
    world, keys, batch = (int(x) for x in torch.randint(1, 5, (3,), generator=gen))
    lengths = torch.randint(0, 6, (world, keys, batch), generator=gen).to(dtype)
    lengths[torch.rand(lengths.shape, generator=gen) < 0.3] = 0
    n = int(lengths.sum())
    return lengths, torch.randint(0, 1000, (n,), generator=gen), torch.rand(n, generator=gen)


@needs_fbgemm
def test_transpose_reference_matches_fbgemm_recat(gen):
    for i in range(20):
        lengths, values, weights = _fixed_transpose_case(gen, INDEX_DTYPES[i % 2])
        world, keys, batch = lengths.shape
        recat = torch.tensor([w * keys + k for k in range(keys) for w in range(world)])
        expected = torch.ops.fbgemm.permute_2D_sparse_data(
            recat.to(torch.int32), lengths.view(world * keys, batch), values, weights
        )
        out_lengths, out_values, out_weights = reference.keyed_transpose(lengths, values, weights)
        assert out_lengths.shape == (keys, world, batch)
        assert torch.equal(out_lengths.view(keys * world, batch), expected[0])
        assert torch.equal(out_values, expected[1]) and torch.equal(out_weights, expected[2])


def _variable_transpose_oracle(lengths, values, batch_sizes, keys):
    """Python loops: cut [rank][key][sample] into blocks, re-concatenate key-major."""
    blocks, row, pos = {}, 0, 0
    for a, b in enumerate(batch_sizes.tolist()):
        for k in range(keys):
            seg = lengths[row : row + b]
            n = int(seg.sum())
            blocks[a, k] = (seg, values[pos : pos + n])
            row, pos = row + b, pos + n
    order = [(a, k) for k in range(keys) for a in range(batch_sizes.numel())]
    return torch.cat([blocks[o][0] for o in order]), torch.cat([blocks[o][1] for o in order])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_transpose_variable_batch(gen, backend):
    if backend == "triton" and not (triton_available() and os.environ["TRITON_INTERPRET"] == "1"):
        pytest.skip("triton interpreter unavailable")
    for _ in range(6):
        world, keys = (int(x) for x in torch.randint(1, 5, (2,), generator=gen))
        batch_sizes = torch.randint(0, 4, (world,), generator=gen)  # a rank may hold 0
        lengths = torch.randint(0, 5, (keys * int(batch_sizes.sum()),), generator=gen)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
        exp_lengths, exp_values = _variable_transpose_oracle(lengths, values, batch_sizes, keys)
        out_l, out_v, _ = keyed_transpose(
            lengths, values, batch_sizes=batch_sizes, num_keys=keys, backend=backend
        )
        assert torch.equal(out_l, exp_lengths) and torch.equal(out_v, exp_values)
        back_l, back_v, _ = keyed_transpose(
            out_l, out_v, batch_sizes=batch_sizes, num_keys=keys, inverse=True, backend=backend
        )
        assert torch.equal(back_l, lengths) and torch.equal(back_v, values)


@pytest.mark.parametrize("backend", ["vectorized", "triton", "naive"])
def test_transpose_backends_match_reference(gen, backend):
    if backend == "triton" and not (triton_available() and os.environ["TRITON_INTERPRET"] == "1"):
        pytest.skip("triton interpreter unavailable")
    for i in range(8):
        lengths, values, weights = _fixed_transpose_case(gen, INDEX_DTYPES[i % 2])
        w = weights if i % 2 else None
        expected = reference.keyed_transpose(lengths, values, w)
        if backend == "naive":
            actual = naive.keyed_transpose(lengths, values, w)
        else:
            actual = keyed_transpose(lengths, values, w, backend=backend)
        for e, a in zip(expected, actual):
            assert (e is None and a is None) or (e.dtype == a.dtype and torch.equal(e, a)), i
        again = keyed_transpose(actual[0], actual[1], actual[2], backend="reference")
        assert torch.equal(again[0], lengths) and torch.equal(again[1], values)


def test_triton_block_plan_over_several_iterations(gen, monkeypatch):
    """The Triton permute / transpose plan their blocks in one program that scans
    `_PLAN_BLOCK` entries per iteration; lowered to 16 here, larger inputs carry the
    scans across iterations: results still equal the reference (int32 and int64), also
    past `_PLAN_MAX_BLOCKS` (lowered to 0), where the shared torch plan runs."""
    if not (triton_available() and os.environ["TRITON_INTERPRET"] == "1"):
        pytest.skip("triton interpreter unavailable")
    from freescale.kernels import triton_impl

    monkeypatch.setattr(triton_impl, "_PLAN_BLOCK", 16)
    for i in range(8):
        dtypes = _dtypes(i)
        if i == 6:  # past the plan's size limit: the torch scans, the same results
            monkeypatch.setattr(triton_impl, "_PLAN_MAX_BLOCKS", 0)
        permute, lengths, values, weights = random_permute_case(
            gen, max_rows=40, max_batch=40 if i % 2 else 7, max_len=9, **dtypes
        )
        if i % 3 == 1:  # a strided view of a permutation
            permute = permute.repeat_interleave(2)[::2]
            lengths = lengths.t().contiguous().t()  # column-major (T, B)
        expected = reference.indexed_permute(permute, lengths, values, weights)
        actual = indexed_permute(permute, lengths, values, weights, backend="triton")
        for e, a in zip(expected, actual):
            assert e.dtype == a.dtype and torch.equal(e, a), i
        dt = INDEX_DTYPES[i % 2]
        world, keys, batch = (int(x) for x in torch.randint(3, 40, (3,), generator=gen))
        tl = torch.randint(0, 6, (world, keys, batch), generator=gen).to(dt)
        tv, tw = torch.randint(0, 1000, (int(tl.sum()),), generator=gen), None
        if i % 2:
            tw = torch.rand(tv.numel(), generator=gen)
        expected = reference.keyed_transpose(tl, tv, tw)
        actual = keyed_transpose(tl, tv, tw, backend="triton")
        for e, a in zip(expected, actual):
            assert (e is None and a is None) or (e.dtype == a.dtype and torch.equal(e, a)), i


# ----------------------------------------------------------------- backend selection


def test_backend_resolution(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    assert resolve_backend("auto", cpu) == "reference"
    assert resolve_backend("vectorized", cpu) == "vectorized"
    monkeypatch.setenv(BACKEND_ENV_VAR, "vectorized")
    assert resolve_backend("auto", cpu) == "vectorized"
    assert resolve_backend("reference", cpu) == "reference"  # the argument wins
    monkeypatch.setenv(BACKEND_ENV_VAR, "bogus")
    with pytest.raises(ValueError):
        resolve_backend("auto", cpu)
    with pytest.raises(ValueError):
        resolve_backend("cuda", cpu)
    monkeypatch.delenv(BACKEND_ENV_VAR)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if triton_available():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            resolve_backend("triton", cpu)


# ------------------------------------------------------------ per-row gradient sums
def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int64 if x.dtype == torch.float64 else torch.int32)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segment_tree_sum_matches_reference_bitwise(gen, dtype):
    """The Triton per-row sum (embedding.reduce.segment_sum on CUDA) equals the reference
    tree bit for bit: signed zeros, infinities, 1-D and wide rows (several column
    blocks), segments spanning several chunk levels, every chunk size."""
    from freescale.embedding.reduce import group_rows, segment_sum, segment_sum_reference
    from freescale.kernels.segment_tree import segment_tree_sum

    shapes = [(1, 4), (7, 1), (300, 3), (1500, 5), (90, 130), (200, None)]
    for i, (n, d) in enumerate(shapes):
        hot = 1 if i == 3 else max(1, n // 8)  # i == 3: one row of 1500 ids
        keys = torch.randint(0, hot, (n,), generator=gen)
        if i == 5:
            keys = torch.randint(0, 1 << 40, (n,), generator=gen)  # mostly distinct
        vals = torch.randn(n if d is None else (n, d), generator=gen, dtype=dtype) * 1e3
        vals[torch.rand(vals.shape, generator=gen) < 0.15] = -0.0
        vals[torch.rand(vals.shape, generator=gen) < 0.10] = 0.0
        vals[torch.rand(vals.shape, generator=gen) < 0.01] = float("inf")
        groups = group_rows(keys)
        ref = segment_sum_reference(vals, groups)
        for chunk in (2, 4, 32):
            got = segment_tree_sum(
                vals, groups.order, groups.starts, groups.counts, groups.max_count, chunk=chunk
            )
            assert got.shape == ref.shape and torch.equal(_bits(got), _bits(ref)), (n, d, chunk)
        assert torch.equal(_bits(segment_sum(vals, groups, backend="triton")), _bits(ref))
    empty = group_rows(torch.zeros(0, dtype=torch.int64))
    assert segment_sum(torch.zeros(0, 4, dtype=dtype), empty, backend="triton").shape == (0, 4)


@needs_triton
def test_segment_tree_sum_keeps_negative_zero_and_tree_order():
    """The two facts the kernel relies on, each checked where a wrong kernel would
    differ: a lone -0.0 stays -0.0 (padding with +0.0 turns it into +0.0), and the sum
    follows the tree, not a running sum ((1e8 + 1) + -1e8 vs 1e8 + (1 + -1e8))."""
    from freescale.embedding.reduce import group_rows
    from freescale.kernels.segment_tree import segment_tree_sum

    vals = torch.tensor([[-0.0], [1e8], [1.0], [-1e8], [3.0]], dtype=torch.float32)
    keys = torch.tensor([0, 1, 1, 1, 1])
    g = group_rows(keys)
    for chunk in (2, 4, 32):
        out = segment_tree_sum(vals, g.order, g.starts, g.counts, g.max_count, chunk=chunk)
        assert _bits(out)[0, 0] == _bits(torch.tensor([-0.0]))[0]
        tree = ((vals[1] + vals[2]) + (vals[3] + vals[4])).item()
        running = (((vals[1] + vals[2]) + vals[3]) + vals[4]).item()
        assert tree != running and out[1, 0].item() == tree


@needs_triton
def test_segment_tree_sum_on_padded_groups(gen):
    """The CUDA sparse update's grouping (group_rows_padded: one slot per id, empty
    padding segments, an upper-bound max count): the Triton per-row sum equals the
    reference on unpadded groups bit for bit on the real slots, incl. a row holding
    every id and all-distinct ids."""
    from freescale.embedding.reduce import group_rows, group_rows_padded, segment_sum_reference
    from freescale.kernels.segment_tree import segment_tree_sum

    cases = [torch.zeros(70, dtype=torch.int64), torch.arange(40), torch.tensor([3])]
    cases += [torch.randint(0, hi, (n,), generator=gen) for n, hi in ((240, 3), (200, 60))]
    for keys in cases:
        vals = torch.randn(keys.numel(), 5, generator=gen) * 1e3
        vals[torch.rand(vals.shape, generator=gen) < 0.2] = -0.0
        ref = segment_sum_reference(vals, group_rows(keys))
        pg = group_rows_padded(keys)
        g = pg.groups
        u = int(pg.num_rows)
        for chunk in (2, 32):
            got = segment_tree_sum(vals, g.order, g.starts, g.counts, g.max_count, chunk=chunk)
            assert got.shape == (keys.numel(), 5)
            assert torch.equal(_bits(got[:u]), _bits(ref)), (keys.numel(), chunk)


@needs_triton
def test_rowwise_adagrad_triton_matches_the_optimizer_bitwise(gen):
    """The fused row-wise Adagrad launch (embedding.optim's CUDA path) leaves weight and
    state bit-for-bit equal to FusedSparseOptimizer's PyTorch arithmetic, on fresh random
    rows / gradients (D = 1, 5, 128, 130: padded and exact trees; tiny and large
    gradients; lr and eps not representable in float32), over three updates, one of
    them with the padded update's repeated last row (150 copies: across programs)."""
    from freescale.config import SparseOptimConfig
    from freescale.embedding.optim import FusedSparseOptimizer
    from freescale.kernels.sparse_optim import rowwise_adagrad_triton

    for dim in (1, 5, 128, 130):
        cfg = SparseOptimConfig(kind="rowwise_adagrad", lr=0.0537, eps=1.1e-8)
        w0 = torch.randn(300, dim, generator=gen) * 0.3
        ref = FusedSparseOptimizer(cfg, w0.clone())
        w = w0.clone()
        state = torch.zeros(300)
        for step in range(1, 4):
            rows = torch.randperm(300, generator=gen)[: int(torch.randint(1, 200, (1,)))]
            g = torch.randn(rows.numel(), dim, generator=gen)
            g *= torch.exp(torch.randn(rows.numel(), 1, generator=gen) * 4)
            if step == 2:  # the padded update: the last row repeated with its gradient
                fill = torch.cat([torch.arange(rows.numel()), torch.full((150,), rows.numel() - 1)])
                rows, g = rows[fill], g[fill]
            lr = cfg.lr / step
            ref.step(rows, g, step=step, lr=lr)
            rowwise_adagrad_triton(w, state, rows, g, lr, cfg.eps, unique_rows=step != 2)
            assert torch.equal(w.view(torch.int32), ref.weight.view(torch.int32)), (dim, step)
            assert torch.equal(state.view(torch.int32), ref.state["sum_sq"].view(torch.int32))
    with pytest.raises(TypeError, match="float32"):
        rowwise_adagrad_triton(w.double(), state.double(), rows, g, 0.1, 1e-8)
    os.environ["FREESCALE_SPARSE_OPTIM"] = "fast"
    try:
        with pytest.raises(ValueError, match="FREESCALE_SPARSE_OPTIM"):
            ref.step(rows, g, step=4)
    finally:
        del os.environ["FREESCALE_SPARSE_OPTIM"]
    with pytest.raises(ValueError, match="grad"):
        rowwise_adagrad_triton(w, state, rows, g[:, :1], 0.1, 1e-8)


_PTX_ORDER_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freescale.kernels import sparse_optim as so
sig = {n: "*fp32" for n in ("w_ptr", "s_ptr", "g_ptr", "new_w_ptr", "new_s_ptr")}
sig |= {"rows_ptr": "*i64", "n_rows": "i32", "dim": "i32", "lr": "fp32", "eps": "fp32"}
for c in ("BR", "WIDTH", "LOG_WIDTH", "IN_PLACE", "BARRIER"):
    sig[c] = "constexpr"
for width, barrier in ((128, True), (8, True), (128, False)):
    const = {"BR": 4096 // width, "WIDTH": width, "LOG_WIDTH": width.bit_length() - 1,
             "IN_PLACE": True, "BARRIER": barrier}
    k = triton.compile(ASTSource(fn=so._rowwise_adagrad_kernel, signature=sig,
                                 constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"enable_fp_fusion": False})
    lines = k.asm["ptx"].splitlines()
    last_ld = max(i for i, x in enumerate(lines) if "ld.global" in x)
    first_st = min(i for i, x in enumerate(lines) if "st.global" in x)
    between = any("bar.sync" in x for x in lines[last_ld:first_st])
    print(width, barrier, last_ld < first_st and between)
"""


def test_in_place_adagrad_orders_every_load_before_every_store_in_ptx():
    """The in-place launch's PTX for an H100/H200 (sm_90, compiled here without a GPU):
    a barrier stands between the program's last global load and its first global store,
    so no warp reads a row state another warp has already stored (the race that moved
    the 1-GPU e2e NE on the H200 before 338e0c7). The barrier-less build (BARRIER=False,
    the GPU check's mutant) must fail the same check, so the check can fail."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _PTX_ORDER_SCRIPT], env=env, text=True,
                         capture_output=True, timeout=300)  # fmt: skip
    if out.returncode != 0 and "ptxas" in out.stderr.lower():
        pytest.skip(f"this triton cannot build sm_90 code here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln.split() for ln in out.stdout.splitlines()]
    assert rows == [["128", "True", "True"], ["8", "True", "True"], ["128", "False", "False"]]


@needs_triton
@pytest.mark.parametrize("update", ["sync", "padded", "ahead"])
def test_fused_adagrad_in_the_collection_is_bitwise_the_reference(gen, update, monkeypatch):
    """The owner's update through ShardedEmbeddingCollection.apply_gradients with the
    fused kernel forced (FREESCALE_SPARSE_OPTIM=triton, interpreter) equals the PyTorch
    optimizer bit for bit in each update mode; the kernel really ran, in place for the
    unique rows of sync / ahead and in two launches for the padded update's repeats."""
    from freescale.comm.base import Communicator
    from freescale.config import SparseOptimConfig, TableConfig
    from freescale.embedding import collection as coll
    from freescale.embedding.reduce import group_rows_start
    from freescale.kernels import sparse_optim

    calls: list[bool] = []
    real = sparse_optim.rowwise_adagrad_triton

    def counting(*args, **kw):
        calls.append(kw.get("unique_rows", False))
        return real(*args, **kw)

    monkeypatch.setattr(sparse_optim, "rowwise_adagrad_triton", counting)
    tables = [TableConfig("item", 300, 8, ["a", "b"]), TableConfig("small", 4, 8, ["c"])]
    cfg = SparseOptimConfig(kind="rowwise_adagrad", lr=0.05)
    seed = int(torch.randint(1 << 20, (1,), generator=gen))
    ref, fused = (coll.ShardedEmbeddingCollection(tables, Communicator(None, name="t"), cfg,
                                                  seed=seed) for _ in range(2))  # fmt: skip
    monkeypatch.setenv(coll.SPARSE_UPDATE_ENV_VAR, update)
    for step in range(1, 5):
        n = int(torch.randint(1, 600, (1,), generator=gen))
        hot = torch.randint(0, 4, (n,), generator=gen)
        keys = torch.where(torch.rand(n, generator=gen) < 0.3, hot + 300, hot * 70 + step)
        grads = torch.randn(n, 8, generator=gen)
        monkeypatch.setenv("FREESCALE_SPARSE_OPTIM", "reference")
        groups = group_rows_start(keys, ahead=False) if update == "ahead" else None
        ref.apply_gradients(keys, grads, step, None, groups=groups)
        monkeypatch.setenv("FREESCALE_SPARSE_OPTIM", "triton")
        groups = group_rows_start(keys, ahead=False) if update == "ahead" else None
        fused.apply_gradients(keys, grads, step, None, groups=groups)
    assert torch.equal(ref.weight.view(torch.int32), fused.weight.view(torch.int32)), update
    s_ref, s_fused = ref.optimizer.state["sum_sq"], fused.optimizer.state["sum_sq"]
    assert torch.equal(s_ref.view(torch.int32), s_fused.view(torch.int32)), update
    assert calls == [update != "padded"] * 4, calls


def _sorted_key_cases(gen: torch.Generator) -> list[torch.Tensor]:
    """Sorted int64 keys: one key, all equal (one run over many blocks), all distinct,
    runs ending exactly at block borders, and fresh random Zipf-like ones (hot runs that
    cross several blocks next to many short runs)."""
    cases = [torch.tensor([7]), torch.full((300,), 3), torch.arange(257) * 2]
    cases.append(torch.repeat_interleave(torch.arange(20), 16))  # runs of one block
    cases.append(torch.cat([torch.zeros(1), torch.ones(63), torch.full((64,), 2)]).long())
    for n in (1, 15, 16, 17, 500, 3000):
        k = (torch.rand(n, generator=gen) ** 4 * n / 3).long()
        cases.append(torch.sort(k).values)
    return cases


@needs_triton
def test_run_stats_triton_matches_reference(gen):
    """group_rows_start's CUDA path (is_start, [runs, longest run]) equals the PyTorch
    reference on fresh sorted keys, with blocks of 16 keys and chunks of 4 blocks (many
    blocks and chunks, runs across them), blocks of 2 keys (up to 600 keys: the
    interpreter runs one program per block) and at the default sizes."""
    from freescale.embedding.reduce import run_stats_reference
    from freescale.kernels.segment_tree import run_stats_triton

    for keys in _sorted_key_cases(gen):
        ref_start, ref_stats = run_stats_reference(keys)
        tiny = [{"block": 2, "chunk": 2}] if keys.numel() <= 600 else []
        for kw in [{"block": 16, "chunk": 4}, *tiny, {}]:
            got_start, got_stats = run_stats_triton(keys, **kw)
            assert torch.equal(got_start, ref_start), (keys.numel(), kw)
            assert torch.equal(got_stats, ref_stats), (keys.numel(), kw, got_stats, ref_stats)
    with pytest.raises(ValueError, match="power of two"):
        run_stats_triton(torch.arange(4), block=3)
    with pytest.raises(ValueError, match="at least one key"):
        run_stats_triton(torch.zeros(0, dtype=torch.int64))


def _mask_cases(gen: torch.Generator) -> list[torch.Tensor]:
    """Bool masks: empty, all set, none set, tiny, and fresh random ones of 1-5 blocks."""
    masks = [torch.zeros(0, dtype=torch.bool), torch.ones(5, dtype=torch.bool)]
    masks += [torch.zeros(7, dtype=torch.bool), torch.tensor([False, True])]
    for n, p in ((1, 0.5), (1000, 0.01), (3000, 0.5), (5000, 0.99)):
        masks.append(torch.rand(n, generator=gen) < p)
    return masks


@needs_triton
def test_mask_partition_triton_matches_reference(gen):
    """The one-launch stable partition (CUDA path of embedding.reduce.mask_partition)
    equals the reference and [nonzero(mask) | nonzero(~mask)] on fresh random masks,
    incl. empty/full/all-false and more than one block; `partition_ranks` is its
    inverse."""
    from freescale.embedding.reduce import mask_partition_reference, partition_ranks
    from freescale.kernels.segment_tree import mask_partition_triton

    for m in _mask_cases(gen):
        count = int(m.sum())
        expected = torch.cat([torch.nonzero(m).squeeze(1), torch.nonzero(~m).squeeze(1)])
        got = mask_partition_triton(m, count)
        assert torch.equal(got, mask_partition_reference(m, count)), m[:8]
        assert torch.equal(got, expected), m[:8]
        inverse = torch.empty_like(expected).scatter_(0, expected, torch.arange(m.numel()))
        assert torch.equal(partition_ranks(m, count), inverse), m[:8]


@needs_triton
def test_mask_positions_triton_matches_reference(gen):
    """The two-launch mask positions (CUDA path of embedding.reduce.mask_positions)
    equal the reference and torch.nonzero on fresh random masks, incl. empty/full."""
    from freescale.embedding.reduce import mask_positions_reference
    from freescale.kernels.segment_tree import mask_positions_triton

    for m in _mask_cases(gen):
        count = int(m.sum())
        got = mask_positions_triton(m, count)
        ref = mask_positions_reference(m, count)
        assert torch.equal(got, ref) and torch.equal(got, torch.nonzero(m).squeeze(1)), m[:8]


def _block_mask_cases(gen: torch.Generator):
    """(lengths, tp, block) for the block-mask tables: empty samples, block-sized and
    off-by-one samples, padding blocks, no tokens at all, one sample, small blocks."""
    from freescale.models.sequence import flex_bucket

    for trial in range(8):
        b = int(torch.randint(1, 12, (1,), generator=gen))
        lengths = torch.randint(0, 300, (b,), generator=gen)
        if trial % 3 == 0:
            lengths = torch.cat([lengths, torch.tensor([128, 256, 1, 0, 127, 129, 0])])
        t = int(lengths.sum())
        tp = flex_bucket(t) if trial % 2 else -(-max(t, 1) // 128) * 128 + 128 * (trial % 3)
        yield lengths, tp, 128
    yield torch.zeros(5, dtype=torch.int64), 256, 128  # no tokens: padding only
    yield torch.tensor([300]), 384, 128  # one sample
    yield torch.tensor([], dtype=torch.int64), 128, 128  # no samples
    for block in (1, 2, 16):
        yield torch.tensor([3, 0, 5, 1, 0, 7]), 32, block


@needs_triton
def test_block_mask_tables_triton_matches_reference(gen):
    """The flex block mask's tables from the two Triton kernels (the CUDA path of
    models.sequence.block_mask_tables) equal the PyTorch reference: every table, dtype
    and shape, int32 and int64 lengths, on fresh random jagged lengths."""
    from freescale.kernels.block_mask import block_mask_tables_triton
    from freescale.models.sequence import _TABLE_NAMES, block_mask_tables_reference

    for lengths, tp, block in _block_mask_cases(gen):
        t = int(lengths.sum())
        ref = block_mask_tables_reference(lengths, tp, t, block)
        for dt in (torch.int64, torch.int32):
            got = block_mask_tables_triton(lengths.to(dt), tp, t, block)
            assert len(got) == len(ref) == len(_TABLE_NAMES)
            for name, x, y in zip(_TABLE_NAMES, got, ref, strict=True):
                where = (name, lengths.tolist(), tp, block, dt)
                assert x.dtype == y.dtype and x.shape == y.shape, where
                assert torch.equal(x, y), where


@needs_triton
def test_block_mask_tables_triton_rejects_bad_arguments():
    from freescale.kernels.block_mask import block_mask_tables_triton

    lengths = torch.tensor([3, 5])
    with pytest.raises(ValueError, match="power of two"):
        block_mask_tables_triton(lengths, 96, 8, 96)
    with pytest.raises(ValueError, match="dividing the padded token count"):
        block_mask_tables_triton(lengths, 100, 8, 128)
    with pytest.raises(ValueError, match="token count 200 not in"):
        block_mask_tables_triton(lengths, 128, 200, 128)


def test_block_mask_first_use_check_catches_a_wrong_table():
    """The once-per-process comparison behind the CUDA path accepts the reference's own
    tables and names the table when one entry is off by one (the mutation it exists
    to catch)."""
    from freescale.models import sequence as seq

    lengths = torch.tensor([130, 0, 7, 300])
    t, tp = int(lengths.sum()), 512
    good = seq.block_mask_tables_reference(lengths, tp, t, 128)
    seq._first_use_check(good, lengths, tp, t, 128)  # equal: no error
    for k, name in enumerate(seq._TABLE_NAMES):
        bad = [x.clone() for x in good]
        bad[k].view(-1)[-1] += 1
        with pytest.raises(RuntimeError, match=f"Triton table '{name}' differs"):
            seq._first_use_check(tuple(bad), lengths, tp, t, 128)


# the only non-pointer runtime arguments Triton may specialize on their value: fixed for
# a run (an embedding row's width), floats (Triton does not specialize floats), or a
# measured exception (a gather's output length: vectorized stores, see triton_impl.py)
SPECIALIZED_OK = {
    ("_row_copy_kernel", "row_width"),
    ("_gather_blocks_kernel", "n_out"),
    ("_rowwise_adagrad_kernel", "lr"),
    ("_rowwise_adagrad_kernel", "eps"),
}


def test_kernels_do_not_specialize_per_call_counts():
    """Every launched Triton kernel leaves its integer arguments unspecialized
    (``do_not_specialize``) unless listed above. Triton compiles a separate variant for
    an int equal to 1 and for a multiple of 16, so a count that changes every call
    would compile a variant at whatever step first shows such a value, stalling the
    host for the compile (session 25 found a late compile making a report's profiled
    bubble 236 ms per step)."""
    import importlib

    from triton.runtime.jit import JITFunction

    from freescale import kernels

    names = ["triton_impl", "triton_dispatch_v4", "segment_tree", "sparse_optim", "block_mask"]
    found = []
    for name in names:
        mod = importlib.import_module(f"{kernels.__name__}.{name}")
        for attr, obj in vars(mod).items():
            if not attr.endswith("_kernel") or not hasattr(obj, "fn"):
                continue
            if not hasattr(obj, "params"):  # the interpreter's wrapper: the same decorator
                dns = obj.kwargs.get("do_not_specialize")  # arguments, compiled
                obj = JITFunction(obj.fn, do_not_specialize=dns)
            found.append(attr)
            for p in obj.params:
                if p.is_constexpr or p.do_not_specialize or p.name.endswith("_ptr"):
                    continue
                assert (attr, p.name) in SPECIALIZED_OK, f"{name}.{attr}: {p.name}"
    assert {"_gather_blocks_kernel", "_v4_scatter_kernel", "_chunk_tree_kernel"} <= set(found)
