"""GEMV decode path: its tile config (`GemvConfig`) and the default tiles per shape and format (`gemv_configs`);
the kernels and launchers are in `gemv.py`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from .dequant import FMT_DENSE, FMT_FP8_BLOCK, FMT_FP8_CHANNEL, FMT_INT4, FMT_NVFP4
from .gemm_args import interpreting
from .workspace import MAX_SYNC_PAIRS

PACKED_MAX_REGISTERS = 96  # int4 and NVFP4 GEMV kernels: registers per thread at most (`gemv_configs`)
WIDE_REGISTERS = 128  # the half dot's K tiles of 512, gate_up's of 1024 at 16 rows (`_half_wide_config`)
_VALUES_PER_WORD = {FMT_DENSE: 2, FMT_INT4: 8, FMT_NVFP4: 8, FMT_FP8_CHANNEL: 4, FMT_FP8_BLOCK: 4}


@dataclass(frozen=True)
class GemvConfig:
    block_n1: int = 32  # rows of gate (and as many of up) per gate_up program
    block_k1: int = 256  # K values per gate_up tile (a power of two, at least one word's values)
    block_n2: int = 64  # rows of w2 per down program
    block_k2: int = 256
    num_warps: int = 4
    prefetch: bool = True  # load the next tile (into registers) before using the current one
    stages: int = 0  # >= 2: instead, Triton's software pipeline over K with this many stages
    fuse_combine: bool = True  # last-arriver combine in the down kernel (else the `combine` kernel)
    one_launch: bool = False  # gate_up and down tiles in one grid (`_fused_kernel`); implies fuse_combine
    tickets: bool = True  # one_launch: tiles taken in arrival order from a counter (else by program id)
    split_k1: int = 1  # gate_up programs per (pair, N block), each over a share of K (two launches only)
    split_k2: int = 1  # down programs per (pair, N block), each over a share of K (two launches, fused sum)
    max_registers: int = 0  # > 0: registers per thread at most (ptxas `maxnreg`); 0: the compiler's choice
    # down's own load mode (a PREFETCH code, see `prefetch_code`) and register cap, where they differ from
    # gate_up's; -1: the same as gate_up's (two launches only)
    down_prefetch: int = -1
    down_max_registers: int = -1
    # NVFP4 and int4: the word dot in packed half math (fp16x2 FMA on x scaled into fp16's range per row;
    # `gemv_half.py`)
    half_dot: bool = False
    # half_dot: each program writes its x' row (scaled, as fp16x2 pairs) once to a workspace and the K loop loads
    # the pairs, instead of converting, scaling and packing x per tile and thread (two launches only)
    half_x_pack: bool = False
    # the pair schedule's smallest width: every program sorts this many keys or the next power of two of the
    # pairs (host pairs first, pool pairs by expert: `gemv_schedule._slot_pair`), so steps of up to this many pairs
    # share one compile; 0: no sort, slot s runs pair s (two launches only)
    schedule_width: int = 64
    # down: each program loads its first K tile before its PDL wait for gate_up and before act's row scale, so the
    # first weights stream in meanwhile (not with down's register prefetch; split K programs do not; gate_up
    # peeled the same way spilled at 128 registers, K tiles of 512 with the half dot, H100 2026-12-05)
    down_peel: bool = False
    # host codes (bank rows read over PCIe) in tiles of half the rows and twice the K, in both kernels: as many
    # values per tile (the same registers), each row read in pieces twice as long; pool rows keep their tiles.
    # Only where K is whole tiles of twice block_k and K is not split (`gemv_args._host_wide`); one launch ignores it.
    # Not a default: with it the kernels took 3-5% longer on resident rows at one token (NVFP4, H100, 2026-12-07:
    # DeepSeek-like layer 79.2 -> 82.5-82.9 µs, Qwen3-like 14.1 -> 14.5-14.6), for 4-5% on a DeepSeek-like layer
    # read wholly from the host and none on the Qwen3-like one (docs/kernels.md)
    host_wide: bool = False
    # down: a host code's even N block reads its rows and the next block's as one tile of 2 x block_n2 rows (twice
    # the bytes in flight over the link per program), its odd block none; pool rows keep their tiles. Where K is
    # not split and host_wide does not take down (`gemv_args._host_tall`); one launch ignores it. The tall tile keeps
    # down's register cap: measured at 32-row blocks (64-row tiles, 94 registers, no spill); at the DeepSeek-like
    # defaults (64-row blocks) it spills (sm_90, Triton 3.8: NVFP4 80 -> 528 stack bytes). Not a default
    host_tall: bool = False

    def __post_init__(self) -> None:
        """ValueError for a config no launch can take, at construction (not at every launch)."""
        for name in ("split_k1", "split_k2"):
            if getattr(self, name) < 1:
                raise ValueError(f"GEMV path: {name}={getattr(self, name)} must be >= 1")
        if self.split_k2 > 1 and not self.fuse_combine:
            raise ValueError(
                f"GEMV path: split_k2={self.split_k2} needs fuse_combine=True (its parts are summed there)"
            )
        if not 0 <= self.max_registers <= 255:
            raise ValueError(f"GEMV path: max_registers={self.max_registers} must be 0 (no limit) or 1..255")
        if not -1 <= self.down_max_registers <= 255 or self.down_prefetch < -1:
            raise ValueError(
                f"GEMV path: down_max_registers={self.down_max_registers} must be 0 (no limit) or 1..255, and "
                f"down_prefetch={self.down_prefetch} >= 0 (-1 for either: gate_up's)"
            )
        if self.one_launch and (self.down_prefetch >= 0 or self.down_max_registers >= 0):
            raise ValueError(
                f"one launch: down_prefetch={self.down_prefetch}, down_max_registers={self.down_max_registers}: "
                "one launch compiles both tiles alike (use -1)"
            )
        if self.half_x_pack and (not self.half_dot or self.one_launch):
            raise ValueError(
                f"GEMV path: half_x_pack packs the half dot's x (half_dot={self.half_dot}) for the two-launch "
                f"path (one_launch={self.one_launch}): set half_dot=True and one_launch=False, or half_x_pack=False"
            )
        if self.down_peel and (self.prefetch_code(down=True) == 1 or self.one_launch):
            raise ValueError(
                f"GEMV path: down_peel loads down's first tile ahead; the register prefetch (prefetch="
                f"{self.prefetch}, down_prefetch={self.down_prefetch}) does so itself and one launch (one_launch="
                f"{self.one_launch}) has no peel: set down_prefetch=0 (or stages) and one_launch=False, or "
                "down_peel=False"
            )
        width = self.schedule_width
        if width < 0 or width & (width - 1) or width > MAX_SYNC_PAIRS or (self.one_launch and width == 0):
            raise ValueError(
                f"GEMV path: schedule_width={width} must be 0 (no sort; two launches only) or a power of two "
                f"<= {MAX_SYNC_PAIRS} (the sync workspace's pairs)"
            )
        if self.one_launch and (self.split_k1 != 1 or self.split_k2 != 1):
            raise ValueError(
                f"one launch: split_k1={self.split_k1}, split_k2={self.split_k2} are for the two-launch path "
                "(use 1)"
            )

    def prefetch_code(self, down: bool = False) -> int:
        """The kernels' PREFETCH: 1 register prefetch, 0 none, >= 2 pipeline stages (`down`: the down kernel's)."""
        if down and self.down_prefetch >= 0:
            return self.down_prefetch
        return self.stages if self.stages >= 2 else int(self.prefetch)

    def registers(self, down: bool = False) -> int:
        """The register cap of gate_up's launch (`down`: down's); 0: none."""
        return self.down_max_registers if down and self.down_max_registers >= 0 else self.max_registers


def _pairs_pow2(num_pairs: int, min_width: int = GemvConfig.schedule_width) -> int:
    """The schedule's width (the kernels' P_POW2): `min_width` up to that many pairs (one compile; the default 64:
    wider steps, 65-128 pairs, take a second one of width 128), else the next power of two; 0 (no sort) stays 0."""
    if num_pairs > MAX_SYNC_PAIRS:
        raise ValueError(f"GEMV path: {num_pairs} routed pairs > {MAX_SYNC_PAIRS}")
    return 0 if min_width == 0 else max(min_width, triton.next_power_of_2(num_pairs))


def gemv_configs(H: int, I: int, fmt: int = FMT_DENSE, num_pairs: int = 8, group: int = 128) -> GemvConfig:
    """Default tiles: ~16 packed words per thread per tile, N blocks halved (down to 8 rows) until pairs x N
    blocks gives at least two programs per SM; int4 and NVFP4 without the register prefetch (the H200 sweeps
    cited below). `group`: int4's group size. int4 takes K tiles of 256 only where they hold whole groups of
    128 (or a multiple) and K is a multiple of 256 (else a tile would load a scale per word: 3x slower with the
    fp32 dot at 256; the wide tiles of `_int4_wide`, 512 values over four groups, load them per word too and were
    faster on the H100 all the same). int4 caps the registers (`max_registers`) where the down grid needs more
    than one wave; NVFP4 takes the half word dot with K tiles of 512 (gate_up 1024 at 16 rows) and its own caps
    (`_half_wide_config`), and so does int4 at one token on wide layers (`_int4_wide`); configs derived from these with
    `dataclasses.replace` keep the caps unless they set them (a one-launch config must reset down's own cap and
    peel: `down_max_registers=-1, down_peel=False`)."""
    if interpreting():  # the interpreter's cost grows with tile size; correctness only
        return GemvConfig(16, 32, 16, 32, num_warps=4)
    vpw = _VALUES_PER_WORD.get(fmt, 2)
    bk = (
        128 if vpw == 2 else 256
    )  # dense: K tiles of 128 were the fastest of the H200 sweep (Qwen3-like, M=1)
    rows = {2: 32, 4: 32, 8: 64}[vpw]  # rows per tile: 32 x 64 words (dense), 32 x 64 (fp8), 64 x 32
    min_programs = 2 * _num_sms()
    bn1, bn2 = rows // 2, rows
    while bn1 > 8 and num_pairs * triton.cdiv(I, bn1) < min_programs:
        bn1 //= 2
    while bn2 > 8 and num_pairs * triton.cdiv(H, bn2) < min_programs:
        bn2 //= 2
    if fmt in (FMT_INT4, FMT_NVFP4):
        # int4: K tiles of 256 (128 bytes of each row per tile, two scales per row at group 128), no pipeline
        # and no register prefetch: the H200 sweep of 2026-12-01 (bench/gemv_sweep.py, M=1) gave DeepSeek-like
        # gate_up 48.7 µs and down 30.6 against 67.5 and 34.3 with K tiles of 128 through a 4-stage pipeline
        # (a read-only kernel of 64-byte row pieces streams at 85% of HBM, of 128-byte pieces at 102%:
        # bench/stream_pattern.py). NVFP4: DeepSeek-like M=1 205.7 vs 245.4 µs without the prefetch.
        # Other int4 groups (64: two per tile, a load per row each; 32: four, a load per word) and a K that is
        # not a multiple of 256: K tiles of 128 without a pipeline (at group 128 as fast as the 4-stage one).
        bk1, bk2 = (_int4_block_k(k, group) for k in (H, I)) if fmt == FMT_INT4 else (bk, bk)
        # down grids of more than one wave at four programs per SM, tiles of 64 rows (16 words per thread): at
        # most 96 registers, five programs of 128 threads per SM instead of four (the compiler took 106 for
        # NVFP4's down kernel, 120 for int4's; no spills at 96). H200, 2026-12-04 (bench.gemv_sweep --set alt
        # --alt max_registers=96): DeepSeek-like NVFP4 down 33.8 -> 31.3 µs at M=1 (896 programs), 205.3 ->
        # 183.8 at M=8; int4 down 30.0 -> 28.7 at M=1; Qwen3-like NVFP4 layer 75.2 -> 71.6 at M=8 (2048);
        # gate_up within 1%. Not on one wave: the Qwen3-like layer at M=1 (512 down programs) took 4-8% longer
        # with it (NVFP4 16.0 -> 17.3 µs, int4 14.9 -> 15.5). At 80 both kernels spill (slower at M=1).
        num_down = num_pairs * triton.cdiv(H, bn2)  # down programs
        if fmt == FMT_NVFP4 or _int4_wide(H, I, group, num_down):
            return _half_wide_config(bn1, bn2, H, I, nvfp4=fmt == FMT_NVFP4)
        one_wave = num_down <= 4 * _num_sms()
        regs = PACKED_MAX_REGISTERS if bn2 >= 64 and not one_wave else 0
        return GemvConfig(bn1, bk1, bn2, bk2, num_warps=4, prefetch=False, max_registers=regs)
    return GemvConfig(bn1, bk, bn2, bk, num_warps=4, prefetch=True)


def _half_wide_config(bn1: int, bn2: int, H: int, I: int, *, nvfp4: bool) -> GemvConfig:
    """NVFP4 (and int4 where `_int4_wide`): the half word dot with K tiles of 512 (32 words per thread; NVFP4 at 16
    rows 1024, `_half_gate_up_block_k`) at 128 registers in gate_up, and in down where I is whole 512 tiles
    (else tiles of 256 at 96 registers, one wave or not). H100, 2026-12-05 (bench.gemv_sweep --set alt, µs per layer against tiles of 256 with the fp32 dot): DeepSeek-like 92.2 -> 83.4 at M=1, 586.5 -> 545.7 at
    M=8; Qwen3-like (I 768: down at 256) 17.3 -> 15.9 at M=1, 74.2 -> 69.1 at M=8. Down at 96 registers on one
    wave too: the Qwen3-like M=1 layer took 17.6 µs with down uncapped (the H200 sweep of 2026-12-04 had found
    the cap 4-8% slower there with the fp32 dot; recheck on the H200). Down's tiles of 512 at 96 registers were
    slower than at 256 (36.2 against 35.2 µs at M=1). gate_up's tiles of 512 at 128 registers with the fp32
    dot: 58.6 against 58.8 µs, 12 registers spilled (the gain needs the half dot's registers).
    Down's first tile loaded before its PDL wait (`down_peel`) and a pair sort of 8 keys at one token instead of
    64 (`schedule_width`): H100, 2026-12-05 (two rounds each), µs per layer at M=1, default -> down_peel ->
    both (first rounds): DeepSeek-like NVFP4 83.2 -> 82.1 -> 80.9, int4 (`_int4_wide`) 81.3 -> 79.8 -> 79.2,
    Qwen3-like NVFP4 15.5 -> 15.1 -> 14.9; NVFP4 at M=8 (64 pairs: the sort is 64 wide either way) 521.7 -> 520.2 -> 520.4. Down
    alone is slower with the peel (32.4 -> 32.6 µs): its gain is the overlap with gate_up's end. int4 with the
    fp32 dot at M=8 was 1.3% slower with it (not taken there)."""
    # down's own cap only where it differs from gate_up's (-1: the same; a config derived for one launch, which
    # compiles both tiles alike, must still reset it where it differs, and down's peel: `dataclasses.replace(...,
    # one_launch=True, down_max_registers=-1, down_peel=False)`)
    bk2, regs2 = (512, -1) if I % 512 == 0 else (256, PACKED_MAX_REGISTERS)
    return GemvConfig(
        bn1,
        _half_gate_up_block_k(bn1, H, nvfp4),
        bn2,
        bk2,
        num_warps=4,
        prefetch=False,
        max_registers=WIDE_REGISTERS,
        down_max_registers=regs2,
        half_dot=True,
        down_peel=True,
        schedule_width=8,
    )


def _half_gate_up_block_k(bn1: int, H: int, nvfp4: bool) -> int:
    """NVFP4 gate_up's K tile: 1024 where the tile has 16 rows (small I at few pairs: the Qwen3-like layer at one
    token) and H is whole 1024 tiles, so a tile holds as many values as one of 32 rows x 512; else 512. H100,
    2026-12-07, zero-copy read 26-27 GB/s (bench.gemv_sweep --set alt, two rounds, µs per layer at M=1,
    Qwen3-like): resident 14.6-14.8 -> 13.8-14.0; every row on the host 889-943 -> 786-816 (86-89% -> 96-103%
    of the zero-copy read: the wider tile reads 512 bytes of codes and 64 of scales per row at a time, not 256 and 32). 128 registers, no spills.
    Not taken at 32 rows (DeepSeek-like M=1, Qwen3-like M>=2): 44-52 registers spilled, the layer 13-40% slower
    resident; 16 rows with 1024 there instead were 0-6% slower resident and 0-15% faster on the host. int4
    (`_int4_wide`) keeps 512: not measured."""
    return 1024 if nvfp4 and bn1 == 16 and H % 1024 == 0 else 512


def _int4_wide(H: int, I: int, group: int, num_down_programs: int) -> bool:
    """int4 takes NVFP4's wide tiles (the half dot, K tiles of 512 in both kernels at 128 registers) where both K
    are whole 512 tiles at group 128 and the down grid is more than one wave and at most two at the four programs
    per SM that 128 registers leave: the regime measured (one token at DeepSeek-like sizes, 896 programs on 132
    SMs). H100, 2026-12-05 (bench.gemv_sweep --set alt, three runs): that layer 83.5-83.8 -> 81.2-81.3 µs (down
    33.7 -> 32.5); at M=8 (7168 down programs) the same tiles were 0.5-1.6% slower; the Qwen3-like layer (I 768,
    masked down tiles, one wave) at M=1 took 16.6 against 15.1 µs. One-wave grids at whole tiles are not measured.
    int4's arithmetic then depends on the batch: the half dot at one token, the fp32 dot at two or more (within
    bf16 rounding of each other: tests/test_gemv_half_gpu.py)."""
    whole = H % 512 == 0 and I % 512 == 0 and group == 128
    per_wave = 4 * _num_sms()
    return whole and per_wave < num_down_programs <= 2 * per_wave


def _int4_block_k(k: int, group: int) -> int:
    """int4 K tile: 256 where each tile holds whole groups of a multiple of 128 and K is whole tiles, else 128."""
    return 256 if group % 128 == 0 and k % 256 == 0 else 128


def _num_sms() -> int:
    return _sms_of(torch.cuda.current_device()) if torch.cuda.is_available() else 132


@functools.cache
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def reg_limit(config: GemvConfig, down: bool = False) -> dict[str, int]:
    """Launch options of gate_up (`down`: of down): ptxas' register limit (`maxnreg`) where the config sets one
    (none on ROCm: its compiler options have no such field; `GemvConfig` checked the value)."""
    regs = config.registers(down)
    if not regs or torch.version.hip:
        return {}
    return {"maxnreg": regs}


def _k_split(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(splits, K tiles per split) for `split` (>= 1, `GemvConfig`) requested shares of K's tiles, none empty."""
    tiles = max(triton.cdiv(k, block_k), 1)  # K = 0: one (empty) share
    per_split = triton.cdiv(tiles, split)
    return triton.cdiv(tiles, per_split), per_split
