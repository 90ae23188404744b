"""How many drafts each request verifies in a step (the scheduler's side; no tensors).

Per request, the drafter reports after each step how many drafts it holds and its confidence in each;
the scheduler keeps an estimate of the request's acceptance rate (an exponential average of accepted /
verified drafts per position). Draft j is worth verifying while the probability that all drafts up to
it are accepted, the product over i <= j of (confidence_i x acceptance), stays above a threshold that
rises with the step's load: at a small batch a decode step is bound by reading the weights and extra
positions are almost free, near a full batch they cost compute (DSpark's load-aware verification).
The load draft j is judged at counts the drafts themselves: the step's rows x (1 + j), what the step
holds when every row verifies j drafts. So each further draft must be likelier to pay than the one
before wherever tokens cost compute (on one CPU thread a few float32 tokens already do), and a batch
that is still bound by the weights' reads with j drafts a row verifies them at the base threshold.

A request whose acceptance falls below `base_threshold` (where not even one draft would be verified on an
idle engine) stops speculating for a cooldown of decode steps (doubling each time it fails again, reset
when it recovers), then probes with one draft: speculation switches itself off where it does not pay,
and comes back where it starts to. A request for which the drafter keeps finding nothing (chat text with
no repeats, for the n-gram drafter) cools down the same way. Steps after which no row may verify drafts
skip the drafting (`wants_drafts`, `StepPlan.propose`).

`fixed` (`--speculative-draft-policy fixed`) verifies every draft the drafter holds, up to `max_draft`:
no estimate, no threshold, no cooldown."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.mailbox.messages import SpecCounters, StepOutput


@dataclass
class SpecState:
    """One request's speculation: what its drafter holds now, and how well its drafts have done."""

    available: int = 0  # drafts the drafter proposed for the request's next step
    confidence: list[float] = field(default_factory=list)
    acceptance: float = 0.7  # estimated P(a draft is accepted | the ones before were), prior to evidence
    verified: int = 0  # drafts verified so far (all steps)
    accepted: int = 0
    off_steps: int = 0  # decode steps left before speculating again
    cooldown: int = 0  # the next cooldown's length (0: none served yet)
    probe: bool = False  # the first step after a cooldown verifies one draft whatever the estimate
    dry: int = 0  # consecutive lookups that found nothing to draft


@dataclass(frozen=True)
class DraftPolicy:
    max_draft: int
    base_threshold: float = 0.2  # P(all accepted) below which a draft is not verified, at no load
    full_load_tokens: int = 1024  # step tokens at which the threshold reaches `max_threshold`
    max_threshold: float = 0.6
    min_evidence: int = 4  # drafts verified before a request may be switched off
    smoothing: float = 0.3  # weight of the newest step in the acceptance average
    first_cooldown: int = 8
    max_cooldown: int = 256
    fixed: bool = False  # verify every draft held (see the module docstring)

    def threshold(self, load_tokens: int) -> float:
        frac = min(1.0, load_tokens / self.full_load_tokens)
        return self.base_threshold + (self.max_threshold - self.base_threshold) * frac

    def draft_len(self, s: SpecState, rows: int, limit: int) -> int:
        """Drafts to verify now (at most `limit`: the request's remaining tokens and context), in a step
        of `rows` decode rows."""
        if self.fixed:
            return min(s.available, self.max_draft, limit)
        if s.off_steps > 0:
            s.off_steps -= 1
            return 0
        if s.probe:
            s.probe = False
            return min(1, s.available, limit)
        k, p = 0, 1.0
        for c in s.confidence[: min(s.available, self.max_draft, limit)]:
            p *= c * s.acceptance
            if p < self.threshold(rows * (k + 2)):  # every row verifying k + 1 drafts
                break
            k += 1
        return k

    def wants_drafts(self, s: SpecState, rows: int) -> bool:
        """Whether drafts made after the step planned now may be verified. Not while a cooldown outlasts
        the next two plans (with overlap the plan after next may go out before the next step's drafts
        reach the host, and the probe then takes the drafts made after this step); nor while even a
        certain first draft falls below its threshold at this load (confidence is at most 1), a state that
        lasts until the load falls, since only verified drafts move the estimate."""
        if self.fixed:
            return True
        if s.off_steps > 1:
            return False
        return s.probe or s.off_steps == 1 or s.acceptance >= self.threshold(2 * rows)

    def observe(self, s: SpecState, verified: int, accepted: int) -> None:
        """A verify step's outcome: `accepted` of its `verified` drafts."""
        if not verified:
            return
        s.verified += verified
        s.accepted += accepted
        # positions after the first rejection say nothing: the rate is per draft reached
        reached = min(verified, accepted + 1)
        rate = accepted / reached
        s.acceptance += self.smoothing * (rate - s.acceptance)
        if s.acceptance < self.base_threshold and s.verified >= self.min_evidence:
            self._cool_down(s)
            s.probe = True
            s.acceptance = self.base_threshold
        elif s.acceptance >= 2 * self.base_threshold:
            s.cooldown = 0

    def _cool_down(self, s: SpecState) -> None:
        """No speculation for the next cooldown: the first one, else twice the last, at most the max."""
        s.cooldown = min(self.max_cooldown, s.cooldown * 2 if s.cooldown else self.first_cooldown)
        s.off_steps = s.cooldown

    def drafts(self, s: SpecState, available: int, confidence: list[float]) -> None:
        """The drafter's proposals for the request's next step. A request for which it keeps finding
        nothing (the n-gram drafter on text that does not repeat) gets no verdict from verification, so
        `min_evidence` empty lookups in a row start a cooldown of their own: drafting stops where it
        finds nothing, and looks again after it (`wants_drafts`)."""
        s.available, s.confidence = available, confidence
        if available or s.off_steps or s.probe:
            s.dry = 0
            return
        s.dry += 1
        if s.dry >= self.min_evidence:
            self._cool_down(s)
            s.dry = 0


@dataclass
class SpecStats:
    """Cumulative speculation figures of a scheduler, for /metrics."""

    max_draft: int
    steps: int = 0  # steps with a verify row
    rows: int = 0  # verify rows (a row verifying in a step)
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    per_position: list[int] = field(default_factory=list)  # [K]: draft j+1 accepted this often
    reached: list[int] = field(default_factory=list)  # [K]: draft j+1 verified this often
    lengths: list[int] = field(default_factory=list)  # [K+1]: rows that emitted 1..K+1 tokens
    draft_s: float = 0.0  # drafting time (device time on CUDA)
    verify_s: float = 0.0  # time of the steps with verify rows
    ahead_rows: int = 0  # verify rows planned before their previous verify step's counts were known

    def __post_init__(self) -> None:
        k = self.max_draft
        self.per_position, self.reached, self.lengths = [0] * k, [0] * k, [0] * (k + 1)

    def row(self, verified: int, accepted: int, ahead: bool = False) -> None:
        self.rows += 1
        self.ahead_rows += ahead
        self.drafted += verified
        self.accepted += accepted
        for j in range(verified):
            self.reached[j] += 1
            self.per_position[j] += j < accepted
        self.lengths[accepted] += 1

    def step(self, verifies: bool, out: StepOutput) -> None:
        self.draft_s += out.draft_s
        if verifies:
            self.steps += 1
            self.verify_s += out.gpu_end - out.gpu_start if out.gpu_end else out.forward_s

    def snapshot(self) -> SpecCounters:
        return SpecCounters(
            steps=self.steps, rows=self.rows, drafted=self.drafted, accepted=self.accepted,
            per_position=list(self.per_position), reached=list(self.reached), lengths=list(self.lengths),
            draft_s=self.draft_s, verify_s=self.verify_s, ahead_rows=self.ahead_rows,
        )  # fmt: skip
