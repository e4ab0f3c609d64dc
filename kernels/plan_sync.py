"""The sync words of the one-launch plan + copy (`plan_copy.py`, whose docstring gives the protocol): role 0
publishes the plan to the spinners (`_wait_for_plan`), and the last program to finish its copies commits the
admitted experts' location codes (`_commit_admitted`). `sync [SYNC_WORDS]` int32 is zero between launches."""

from __future__ import annotations

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]

# word 0: low 16 bits published pairs + 1 (0: not yet; the pairs to copy, 0..n-1: LRU's admissions, the adaptive
# plans' pairs up to the last admitted one), high bits arrivals of roles 1..P-1; word 1:
# programs whose admission copies are stored (only when something was admitted); word 2: tickets drawn (a plain
# grid's programs take their roles in the order they start: `_draw_ticket`)
SYNC_WORDS = 3
ARRIVAL = 1 << 16  # one arrival in word 0

if triton is not None:
    _ARRIVAL = tl.constexpr(ARRIVAL)

    @triton.jit
    def _draw_ticket(sync_ptr, num_programs):
        """The calling program's role, 0..P-1, in the order the programs reach here (one relaxed atomic at
        `sync[2]`; the program that draws P-1 resets the word: every other program has drawn before it).
        Why: the spinners wait for role 0, and a plain grid's programs need not all be resident at once; the
        program that draws ticket 0 is running, so whoever waits for it waits for a running program (the
        decoupled look-back argument), with no cooperative launch."""
        ticket = tl.atomic_add(sync_ptr + 2, 1, sem="relaxed", scope="gpu")
        if ticket == num_programs - 1:
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed", scope="gpu")
        return ticket

    @triton.jit
    def _wait_for_plan(sync_ptr, num_programs):
        """Roles 1..P-1: wait until role 0 published, return the published pair count; the last one resets."""
        seen = tl.load(sync_ptr, volatile=True)
        while seen == 0:  # each thread polls on its own: the warps of a program leave at different times
            seen = tl.load(sync_ptr, volatile=True)
        # Every warp of this program has seen the publication before it counts as arrived: the arrival below is
        # one thread's, and once all roles have arrived the last one resets the word to 0, so a warp of another
        # program still in the loop then would spin forever. Roles by ticket had a barrier here by accident
        # (Triton's shared-memory analysis: the arrival's broadcast reuses the ticket's slot), roles by program
        # id (the cooperative launch) had none; the hang was never observed (bench/sync_stress.py).
        tl.debug_barrier()
        # one read-modify-write: acquires role 0's release (its pairs), counts this arrival in the high bits
        word = tl.atomic_add(sync_ptr, _ARRIVAL, sem="acquire", scope="gpu")
        if word // _ARRIVAL == num_programs - 2:  # the last arriver: every spinner has read it
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        return word % _ARRIVAL - 1

    @triton.jit
    def _commit_admitted(sync_ptr, l2p_ptr, codes_ptr, victims_ptr, valid_ptr, base, R, num_published,
                         num_programs, BLOCK_E: tl.constexpr):  # fmt: skip
        """After this program's copies: arrive at `sync[1]`; the last of the P arrivals writes the admitted
        experts' rows (pairs 0..n-1 of the published n with `valid != 0`) into the location table (release:
        their copies happen before) and resets the word."""
        tl.debug_barrier()  # every thread's copy stores happen before the (one-thread, release) arrival
        arrived = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if arrived == num_programs - 1:
            i = tl.arange(0, BLOCK_E)
            # volatile: written in this launch by role 0 (no stale L1 line)
            mine = i < num_published
            mine = mine & (tl.load(valid_ptr + i, mask=mine, other=0, volatile=True) != 0)
            expert = tl.load(codes_ptr + i, mask=mine, other=R, volatile=True) - R
            row = tl.load(victims_ptr + i, mask=mine, other=0, volatile=True)
            tl.atomic_xchg(l2p_ptr + base + expert, row, mask=mine, sem="release", scope="gpu")
            tl.store(sync_ptr + 1, 0)  # ready for the next launch (stream order: it starts after this one)
