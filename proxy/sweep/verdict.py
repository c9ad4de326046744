"""The sweep's verdict: pure rules that say what changed with concurrency, with the numbers behind it.

The lowest level is the baseline. Eight kinds (`VerdictKind`); rules, first match wins:
1. fewer than two levels, or under two responses at the lowest -> `insufficient_data`;
2. already at the lowest level most answers are cut -> `baseline_truncation` (the cause named, and
   what more load adds to it, where it adds anything);
3. the completion rate falls with concurrency and a timeout or limit dominates the cut
   responses (deadline, idle timeout, rejection, the client's own timeout) -> `policy`;
4. the completion rate falls and another cause dominates (a server-side token limit, upstream
   errors or OOM, upstream disconnects) -> `serving_defect`;
5. output length falls while stop reasons stay complete and durations cluster at one value
   -> `hidden_cap` (inferred: a wall-clock cap returning partial text as complete);
   without the cluster -> `length_shift` (inferred, cause not shown);
6. answers that still complete pass a deadline the proxy only observes -> `policy`;
7. the answers end on their own at every level but their text differs from the baseline's one
   text -> `batch_nondeterminism` (the batch shape, not truncation);
8. otherwise only latency moved -> `no_load_effect`, with the length difference and its interval.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from proxy.record import ResponseRecord
from proxy.servers import server_described
from proxy.servers.base import ServerInfo
from proxy.sweep import timeouts
from proxy.sweep.limits import CONTEXT_SLACK, characterise
from proxy.sweep.sample import Sample
from proxy.sweep.stats import (
    Interval,
    LevelSummary,
    bootstrap_mean_difference,
    is_complete,
    median,
    output_tokens,
    stop_label,
)

VerdictKind = Literal["insufficient_data", "baseline_truncation", "policy", "serving_defect",
                      "hidden_cap", "length_shift", "batch_nondeterminism", "no_load_effect"]

# A level "falls" when its completion rate is this many points below the baseline's, with at
# least MIN_CUT responses not complete (one odd response is not a pattern).
COMPLETION_DROP = 0.10
MIN_CUT = 2
# Output length "falls" when the mean is this share below the baseline's and the bootstrap
# interval of the difference lies wholly below zero.
LENGTH_DROP = 0.10
# Durations "cluster" when this share lies within the tolerance of their median, and almost
# none above it (a cap is a ceiling).
CLUSTER_SHARE = 0.6
CLUSTER_ABOVE_SHARE = 0.1
CLUSTER_REL_TOLERANCE = 0.05
CLUSTER_ABS_TOLERANCE_S = 0.05
# Below this completion rate at the baseline, completion cannot show a load effect.
BASELINE_MIN_COMPLETION = 0.5

POLICY_CAUSES = ("deadline", "idle_timeout", "rejected", "client_disconnect")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the sweep shows, in one headline, the numbers behind it and what to do next."""

    kind: VerdictKind
    headline: str
    cause: str | None
    onset_level: int | None
    inferred: bool
    evidence: tuple[str, ...]
    recommendation: str
    length_difference: Interval | None = None
    baseline: str | None = None  # what cuts answers at every level, where a load effect comes on top of it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        """The verdict as printed: headline, evidence lines, recommendation."""
        lines = [f"VERDICT ({self.kind}{', inferred' if self.inferred else ''}): {self.headline}"]
        if self.baseline is not None:
            lines.append(f"  and at every level, the baseline: {self.baseline}")
        lines += [f"  - {line}" for line in self.evidence]
        lines.append(f"  => {self.recommendation}")
        return "\n".join(lines)


def decide(summaries: Sequence[LevelSummary], groups: Mapping[int, Sequence[Sample]], *,
           client_timeout_s: float | None = None, server: ServerInfo | None = None) -> Verdict:
    """The verdict for a sweep: `summaries` lowest level first, `groups` the samples per level;
    `server` is what the server says of its context, to name a length limit by its number."""
    verdict = _decide(summaries, groups, client_timeout_s, server)
    whole_below = [s.level for s in summaries if verdict.onset_level is not None and s.level < verdict.onset_level]
    if verdict.kind in ("policy", "serving_defect") and whole_below and verdict.cause not in PROXYS_OWN:
        # The highest level seen whole, not the onset minus one: a level between them was never tried.
        verdict = replace(verdict, recommendation=f"{verdict.recommendation}; "
                                                  f"{lower_concurrency(max(whole_below), server)}")
    records = [s.record for samples in groups.values() for s in samples]
    shifted = _context_shift_line(records, server)
    found = [*([shifted] if shifted else []), *timeouts.lines(records)]
    return replace(verdict, evidence=(*verdict.evidence, *found)) if found else verdict


def lower_concurrency(limit: int, server: ServerInfo | None) -> str:
    """Advice to run at most `limit` at once, with the switch that does it: the server's own, the
    proxy's gate, and the sweep that proves it."""
    own = server_described(server.source if server is not None else None).concurrency_switch(limit)
    switch = f"the server's own {own}, or " if own else ""
    return (f"to run at most {limit} at once: {switch}the proxy's --max-in-flight {limit} (for a server without "
            f"such a setting, or several applications sharing one server); prove it with `llm-diag-proxy sweep "
            f"--target PROXY --admin PROXY_ADMIN --model MODEL --admission {limit}`")


def _context_shift_line(records: Sequence[ResponseRecord], server: ServerInfo | None) -> str | None:
    """Answers longer than the context the server says a request gets: it shifted the context (dropped
    the oldest tokens to go on), which llama-server reports only on /completion (`truncated`)."""
    if server is None or server.context_per_request is None:
        return None
    limit = server.context_per_request + CONTEXT_SLACK
    # Answers only: a refusal's prompt count (an over-long prompt) is no context that was shifted.
    sums = [r.prompt_tokens + r.output_tokens for r in records
            if r.prompt_tokens is not None and r.output_tokens is not None and r.upstream_error is None
            and r.status is not None and 200 <= r.status < 300]
    past = [total for total in sums if total > limit]
    if not past:
        return None
    return (f"{len(past)} of {len(records)} answers ran past the {server.context_per_request:,}-token context the "
            f"server says a request gets (prompt + output up to {max(past):,}): it shifted the context, dropping "
            "the oldest tokens, which a chat route does not report")


def _decide(summaries: Sequence[LevelSummary], groups: Mapping[int, Sequence[Sample]],
            client_timeout_s: float | None, server: ServerInfo | None) -> Verdict:
    if len(summaries) < 2 or summaries[0].n < 2:
        return Verdict("insufficient_data", "too few levels or responses to compare", None, None, False,
                       (f"{len(summaries)} level(s), {summaries[0].n if summaries else 0} response(s) "
                        "at the lowest",),
                       "sweep at least two levels with --repeats 2 or more")
    base, top = summaries[0], summaries[-1]
    difference = bootstrap_mean_difference([float(output_tokens(s.record)) for s in groups[base.level]],
                                           [float(output_tokens(s.record)) for s in groups[top.level]])
    latency = _latency_line(base, top)
    if base.completion_rate < BASELINE_MIN_COMPLETION:
        baseline = _baseline_truncation(base, groups[base.level], latency, client_timeout_s, server)
        return _beyond_baseline(summaries, groups, baseline, client_timeout_s, server) or baseline
    onset = next((s for s in summaries[1:]
                  if base.completion_rate - s.completion_rate >= COMPLETION_DROP
                  and s.n - s.complete >= MIN_CUT), None)
    if onset is not None:
        return _truncation(summaries, groups, onset, difference, latency, client_timeout_s, server)
    answers = _same_answers(summaries, groups)
    length_onset = _length_onset(summaries, groups)
    if length_onset is not None:
        fallen = _length_fall(summaries, groups, length_onset, latency)
        return replace(fallen, evidence=(*fallen.evidence, answers.line)) if answers is not None else fallen
    observed = _observed_deadline(summaries)
    if observed is not None:
        return Verdict(
            "policy", f"responses pass the proxy's deadline from concurrency {observed.level} "
                      "(observed, not enforced)", "deadline_observed", observed.level, False,
            (_completion_line(summaries), f"{observed.deadline_hits} of {observed.n} responses at "
             f"concurrency {observed.level} passed the deadline; all still completed", latency),
            f"disclose the deadline and keep concurrency below {observed.level}, or a client that "
            "enforces it will see cut answers", difference)
    if answers is not None and answers.onset is not None:
        return _changed_answers(summaries, answers, difference, latency)
    calm = _no_load_effect(summaries, difference, latency)
    return replace(calm, evidence=(*calm.evidence, answers.line)) if answers is not None else calm


@dataclass(frozen=True, slots=True)
class Answers:
    """The seeded answers' texts across levels (by hash): the same as at the lowest level, or not."""

    line: str
    onset: LevelSummary | None = None  # the first level whose complete answers changed
    changed: int = 0
    compared: int = 0


def _same_answers(summaries: Sequence[LevelSummary], groups: Mapping[int, Sequence[Sample]]) -> Answers | None:
    """Whether complete answers keep the lowest level's text (None: the sweep kept no hashes)."""
    def hashes(level: int) -> list[str]:
        return [s.client.answer_hash for s in groups[level] if is_complete(s.record) and s.client.answer_hash]

    base = summaries[0]
    own = hashes(base.level)
    if len(own) < 2:
        return None
    texts = set(own)
    if len(texts) > 1:
        return Answers(f"answers differ already at c={base.level} ({len(texts)} texts among {len(own)} complete "
                       "answers to one seeded request): the seed does not fix this server's answers, so their text "
                       "cannot show a load effect")
    onset, changed, compared = None, 0, 0
    for summary in summaries[1:]:
        found = hashes(summary.level)
        moved = sum(1 for h in found if h not in texts)
        if onset is None and moved >= MIN_CUT:
            onset = summary
        if onset is not None:
            changed, compared = changed + moved, compared + len(found)
    if onset is None:
        total = sum(len(hashes(s.level)) for s in summaries)
        return Answers(f"every complete answer was the same text at every level ({total} answers, one text): "
                       "the strongest form of no load effect")
    by_level = ", ".join(f"c={s.level}: {sum(1 for h in hashes(s.level) if h not in texts)}/{len(hashes(s.level))}"
                         for s in summaries)
    return Answers(f"complete answers whose text differs from c={base.level}'s one text: {by_level}", onset,
                   changed, compared)


def _changed_answers(summaries: Sequence[LevelSummary], answers: Answers, difference: Interval | None,
                     latency: str) -> Verdict:
    assert answers.onset is not None
    onset, base = answers.onset, summaries[0]
    share = answers.changed / max(answers.compared, 1)
    return Verdict(
        "batch_nondeterminism",
        f"answers end on their own at every level, but from concurrency {onset.level} {_pct(share)} of them are "
        f"another text than at c={base.level}: batch-shape nondeterminism, not truncation",
        "batch_shape", onset.level, True,
        (_completion_line(summaries), answers.line, "the seed, prompt, budget and temperature were the same for every "
         "request; only concurrency changed: the server's numerics depend on the batch it runs in", latency),
        "the answers are complete; where the text must not depend on load, turn on the server's batch-invariant "
        "kernels (vLLM: VLLM_BATCH_INVARIANT=1; SGLang: --enable-deterministic-inference), at some cost in "
        "throughput", difference)


def _baseline_truncation(base: LevelSummary, samples: Sequence[Sample], latency: str,
                         client_timeout_s: float | None, server: ServerInfo | None) -> Verdict:
    causes = Counter(stop_label(s.record) for s in samples if not is_complete(s.record))
    cause, count = causes.most_common(1)[0]
    cut = [s for s in samples if stop_label(s.record) == cause]
    words, explained, remedy = _cause_words(cause, cut, server, {base.level: cut})
    detail = [*explained, *_cause_detail(cause, cut, client_timeout_s)]
    if cause == "length:requested_budget" and any(s.record.budget_mostly_reasoning for s in samples):
        advice = (f"the budget of {base.requested_max_tokens} tokens goes mostly to reasoning: raise "
                  "--max-tokens (or lower the reasoning effort) so answers can end on their own; only then "
                  "can the completion rate show a load effect")
    elif cause == "length:requested_budget":
        advice = (f"raise --max-tokens above {base.requested_max_tokens} so answers can end on their "
                  "own; only then can the completion rate show a load effect")
    elif remedy is not None:
        advice = f"{remedy}; it happens already at concurrency {base.level}: it is not a load effect"
    else:
        advice = f"fix '{cause}' at concurrency {base.level} first: it is not a load effect"
    return Verdict(
        "baseline_truncation",
        f"already at concurrency {base.level} only {_pct(base.completion_rate)} of answers completed: "
        f"{words}",
        cause, base.level, False,
        (f"{count} of {base.n} responses at concurrency {base.level} ended with {cause}", *detail, latency),
        advice)


def _beyond_baseline(summaries: Sequence[LevelSummary], groups: Mapping[int, Sequence[Sample]], baseline: Verdict,
                     client_timeout_s: float | None, server: ServerInfo | None) -> Verdict | None:
    """What load adds on top of a baseline: a cause that appears with concurrency (clients giving
    up, errors, rejections) or one that grows (a server limit cutting more). The baseline's own
    cause growing counts too, but for the client's budget: more budget stops is no load effect."""
    base = summaries[0]
    kept = baseline.cause

    def load_cuts(level: int) -> list[Sample]:
        return [s for s in groups[level] if not is_complete(s.record) and stop_label(s.record) != kept]

    def kept_cuts(level: int) -> list[Sample]:
        return [s for s in groups[level] if stop_label(s.record) == kept]

    grows = kept is not None and kept != "length:requested_budget"
    onset, cause_of = None, ""
    for summary in summaries[1:]:
        new = len(load_cuts(summary.level))
        if new - summary.n * len(load_cuts(base.level)) / base.n >= max(MIN_CUT, COMPLETION_DROP * summary.n):
            onset, cause_of = summary, "new"
            break
        more = len(kept_cuts(summary.level)) / summary.n - len(kept_cuts(base.level)) / base.n
        if grows and more >= COMPLETION_DROP and len(kept_cuts(summary.level)) - len(kept_cuts(base.level)) >= MIN_CUT:
            onset, cause_of = summary, "grown"
            break
    if onset is None:
        return None
    affected = [s for s in summaries if s.level >= onset.level]
    if cause_of == "grown":
        assert kept is not None
        cause, picked = kept, kept_cuts
    else:
        found = Counter(stop_label(s.record) for summary in affected for s in load_cuts(summary.level))
        cause = found.most_common(1)[0][0]

        def picked(level: int) -> list[Sample]:
            return [s for s in load_cuts(level) if stop_label(s.record) == cause]
    by_level_cut = {summary.level: picked(summary.level) for summary in affected}
    cut_samples = [s for cut in by_level_cut.values() for s in cut]
    words, explained, remedy = _cause_words(cause, cut_samples, server, by_level_cut)
    shares = ", ".join(f"c={s.level}: {len(picked(s.level))}/{s.n}" for s in summaries)
    evidence = (f"{cause} by concurrency: {shares}" + (" (it grows with load)" if cause_of == "grown" else
                                                       " (it comes with load)"),
                *explained, *_cause_detail(cause, cut_samples, client_timeout_s),
                f"the baseline, already at c={base.level}: " + "; ".join(baseline.evidence[:1]),
                _completion_line(summaries))
    if cause in POLICY_CAUSES:
        name = _policy_name(cause, client_timeout_s)
        return Verdict(
            "policy", f"{name} ends answers from concurrency {onset.level}, on top of a baseline", cause, onset.level,
            False, evidence,
            f"disclose this policy ({name}, from concurrency {onset.level}) and set capacity below {onset.level} "
            f"concurrent requests, or raise the limit; and for the baseline: {baseline.recommendation}",
            baseline=baseline.headline)
    return Verdict(
        "serving_defect", f"answers are cut by {cause} from concurrency {onset.level}, on top of a baseline: {words}",
        cause, onset.level, False, evidence,
        f"a serving defect: {remedy or f'fix {cause!r} under load'} (it starts at concurrency {onset.level}); and "
        f"for the baseline: {baseline.recommendation}", baseline=baseline.headline)


def _truncation(summaries: Sequence[LevelSummary], groups: Mapping[int, Sequence[Sample]],
                onset: LevelSummary, difference: Interval | None, latency: str,
                client_timeout_s: float | None, server: ServerInfo | None) -> Verdict:
    affected = [s for s in summaries if s.level >= onset.level]
    causes: Counter[str] = Counter()
    for summary in affected:
        for sample in groups[summary.level]:
            if not is_complete(sample.record):
                causes[stop_label(sample.record)] += 1
    cause, count = causes.most_common(1)[0]
    total_cut = sum(causes.values())
    share = (f"{count} of {total_cut} cut responses at concurrency >= {onset.level} "
             f"({_pct(count / total_cut)})")
    cut_samples = [s for summary in affected for s in groups[summary.level]
                   if stop_label(s.record) == cause]
    by_level_cut = {summary.level: [s for s in groups[summary.level] if stop_label(s.record) == cause]
                    for summary in affected}
    words, explained, remedy = _cause_words(cause, cut_samples, server, by_level_cut)
    evidence = [_completion_line(summaries), f"dominant cause {cause}: {share}", *explained,
                *_cause_detail(cause, cut_samples, client_timeout_s), latency]
    others = [f"{k} {v}" for k, v in causes.most_common()[1:]]
    if others:
        evidence.insert(2, "other causes: " + ", ".join(others))
    if cause in POLICY_CAUSES:
        name = _policy_name(cause, client_timeout_s)
        return Verdict(
            "policy", f"{name} ends answers from concurrency {onset.level}", cause, onset.level, False,
            tuple(evidence),
            f"disclose this policy ({name}, from concurrency {onset.level}) and set capacity below "
            f"{onset.level} concurrent requests, or raise the limit", difference)
    if cause == "prompt_truncated":
        headline = f"prompts are cut on the way in from concurrency {onset.level}: {words}"
    else:
        headline = (f"answers are cut by {cause} from concurrency {onset.level}, before the requested budget "
                    f"of {onset.requested_max_tokens or 'unknown'} tokens: {words}")
    if cause in PROXYS_OWN:
        recommendation = f"the proxy's own defect: {remedy}"
    else:
        recommendation = (f"a serving defect: {remedy or f'fix {cause!r} under load'} (it starts at concurrency "
                          f"{onset.level}); until then keep concurrency below {onset.level}")
    return Verdict("serving_defect", headline, cause, onset.level, False, tuple(evidence), recommendation, difference)


# Causes that are the proxy's own defect: no concurrency of the server's is their remedy.
PROXYS_OWN = frozenset({"proxy_error"})

# Each cause in the words an operator acts on; a length limit is characterised from its records.
CAUSE_WORDS: dict[str, str] = {
    "upstream_error:context_exhausted": "the KV cache / context ran out (a pool the requests share)",
    "upstream_error:exceeds_context": "the request does not fit the context one request gets",
    "interrupted": "the server interrupted running streams (ended without a final event), as "
                   "llama-cpp-python's server does to one when another request queues, and vLLM to a "
                   "request aborted before its first token",
    "upstream_disconnect": "the upstream connection broke mid-answer",
    "upstream_error": "the server failed the request (see the error kinds)",
    "repetition": "the server cut answers it judged repeating",
    "length:requested_budget": "answers ran into the client's own budget",
    "length:unknown": "length stops whose cause the counted tokens cannot tell (no usage from the server)",
    "prompt_truncated": "the server cut the prompt on the way in: the answers end on their own and look "
                        "complete, but answer what was left of the question",
    "not_generated": "the server generated nothing (Ollama's done_reason load: it treated the request as a "
                     "model load)",
    "not_generated:no_user_turn": "the server generated nothing: the chat has no user turn (Ollama loads the "
                                  "model and answers done_reason load)",
    "answer_incomplete:tool_call": "answers said they ended, but a tool call's arguments are not whole JSON: "
                                   "the agent cannot use them",
    "answer_incomplete:json": "answers asked to be JSON said they ended, but their JSON is not whole",
    "model_unloaded": "the server unloaded, swapped or evicted the model while answers ran (its own list of "
                      "loaded models stopped naming it), and they broke off",
    "undelivered": "the server finished answers (its own spans say so) whose streams broke before their end: "
                   "they were cut between the server's engine and the proxy",
    "proxy_error": "the proxy's own code failed on these exchanges and ended them: a defect of llm-diag-proxy, "
                   "not of the server",
    "proxy_shutdown": "the proxy was stopped while these answers ran, and ended them past its shutdown grace",
}


# What to do about each, where the cause says it (a length limit: by what it turned out to be).
CAUSE_ADVICE: dict[str, str] = {
    "context": "give each request more context: raise the server's context (llama.cpp --ctx-size, vLLM "
               "--max-model-len, Ollama num_ctx) or split it over fewer parallel slots",
    "clamp": "the server or a gateway lowers the budget: find that cap (a max_tokens default or limit) and raise it",
    "load_clamp": "the server trims budgets to its free KV cache: add KV capacity, or lower the concurrency",
    "upstream_error:context_exhausted": "the KV pool the requests share runs out: give it more context, give "
                                        "each slot a fixed share (no --kv-unified), or lower the concurrency",
    "upstream_error:exceeds_context": "shorten the prompts, or raise the context one request gets",
    "interrupted": "the server ends a running stream when another request queues (llama-cpp-python's "
                   "interrupt_requests): turn that off (--interrupt_requests false) or serve one at a time; "
                   "with vLLM, find what aborts requests (its abort endpoint, a gateway's timeout)",
    "prompt_truncated": "give each request more context (Ollama: options.num_ctx or OLLAMA_CONTEXT_LENGTH, and "
                        "fewer OLLAMA_NUM_PARALLEL slots when it splits its context between them; llama.cpp: "
                        "--ctx-size or fewer --parallel slots, or no --context-shift) or shorten the prompts",
    "not_generated:no_user_turn": "send at least one user turn: a chat of system messages alone is answered "
                                  "with nothing",
    "answer_incomplete:tool_call": "raise max_tokens for tool calls (vLLM reports a call cut by the budget as "
                                   "tool_calls, vllm#53269) and treat a call whose arguments do not parse as cut",
    "answer_incomplete:json": "check the server's structured-output backend (it ended inside the JSON) and give "
                              "the answer room to close it",
    "model_unloaded": "keep the model loaded while it serves: more memory for the models in rotation (Ollama "
                      "OLLAMA_MAX_LOADED_MODELS, llama.cpp's router --models-max), a longer keep-alive, or one "
                      "model per server",
    "undelivered": "find what cuts streams between the server and the proxy: a gateway's or load balancer's "
                   "timeout or buffer on that path, or the server's own HTTP layer (its logs at those times)",
    "proxy_error": "report it with the proxy's exchange_failed log lines (the error's type and where it was "
                   "raised); these answers say nothing of the server",
}


def _cause_words(cause: str, samples: Sequence[Sample], server: ServerInfo | None,
                 by_level_cut: Mapping[int, Sequence[Sample]]) -> tuple[str, list[str], str | None]:
    """The cause in an operator's words, what the records (and the server) show of it, and advice."""
    if cause == "length:server_limit":
        found = characterise([s.record for s in samples], server,
                             [(level, [s.record for s in cut]) for level, cut in by_level_cut.items()])
        return found.words, list(found.evidence), CAUSE_ADVICE.get(found.kind)
    advice = CAUSE_ADVICE.get(cause)
    if cause == "upstream_error:exceeds_context" and server is not None and server.context_per_request:
        return (f"the request does not fit the context one request gets ({server.context_per_request:,} "
                f"tokens{', ' + str(server.slots) + ' slots' if server.slots else ''}, {server.source})", [],
                advice)
    if cause == "upstream_error:context_exhausted" and server is not None:
        return CAUSE_WORDS[cause], [f"the server says {server.describe()}"], advice
    if cause == "prompt_truncated":
        return CAUSE_WORDS[cause], _prompt_cut_lines(samples, server, by_level_cut), advice
    return CAUSE_WORDS.get(cause, cause), [], advice


def _prompt_cut_lines(samples: Sequence[Sample], server: ServerInfo | None,
                      by_level_cut: Mapping[int, Sequence[Sample]]) -> list[str]:
    """How the cut prompts were shown, what the server says of its context, and, when the cuts grow
    with concurrency, the split that would explain them."""
    records = [s.record for s in samples]
    counted = sorted(r.prompt_tokens for r in records if r.prompt_tokens is not None)
    contexts = sorted({r.context_tokens for r in records if r.context_tokens})
    lines = []
    if counted:
        lines.append(f"the server evaluated {_range(counted)} prompt tokens of these"
                     + (f" (context {', '.join(f'{c:,}' for c in contexts)} tokens per request)" if contexts else ""))
    details = [r.prompt_truncated_detail for r in records if r.prompt_truncated_detail]
    if details:
        lines.append(f"how it shows: {_mode(details)}")
    if server is not None:
        lines.append(f"the server says {server.describe()}")
    levels = sorted(level for level, cut in by_level_cut.items() if cut)
    if len(levels) > 1 or (levels and levels[0] > 1):
        lines.append("the cut grows with concurrency: a context shared between parallel requests (Ollama "
                     "with OLLAMA_NUM_PARALLEL, llama.cpp's --parallel slots) gives each less of it")
    return lines


def _policy_name(cause: str, client_timeout_s: float | None) -> str:
    if cause == "deadline":
        return "the proxy's enforced total deadline (--deadline)"
    if cause == "idle_timeout":
        return "the proxy's enforced idle timeout between chunks (--idle-timeout)"
    if cause == "rejected":
        return "admission control (requests rejected)"
    timeout = f" of {client_timeout_s:g} s" if client_timeout_s else ""
    return f"the client's timeout{timeout}"


def _reasoning_line(records: Sequence[ResponseRecord]) -> list[str]:
    """For length stops: how much of the budget went to thinking, when that is most of it."""
    heavy = [r for r in records if r.budget_mostly_reasoning]
    if not heavy:
        return []
    shares = [r.reasoning_share or 0.0 for r in heavy]
    visible = [float(r.visible_tokens) for r in heavy if r.visible_tokens is not None]
    answer = f"; the visible answer got a median {median(visible):g} tokens" if visible else ""
    empty = sum(1 for r in heavy if r.visible_tokens == 0)
    nothing = f"; {empty} of them showed no answer at all: the answer budget went to thinking" if empty else ""
    return [f"{len(heavy)} of {len(records)} of these spent most of the budget on reasoning (median "
            f"{_pct(median(shares) or 0.0)} of it){answer}{nothing}"]


def _cause_detail(cause: str, samples: Sequence[Sample], client_timeout_s: float | None) -> list[str]:
    """Numbers that characterise one cause: where the limit sits."""
    records = [s.record for s in samples]
    if cause == "length:requested_budget":
        calls = [r for r in records if r.incomplete_part == "tool_call"]
        named = (f"{len(calls)} of these were tool calls cut mid-arguments by the budget though the server said "
                 f"{_mode([r.finish_reason_raw or '?' for r in calls])!r}" if calls else None)
        return [*([named] if named else []), *_reasoning_line(records)]
    if cause.startswith("not_generated"):
        details = [r.stop_detail for r in records if r.stop_detail]
        return [f"{len(records)} answers were never generated" + (f": {_mode(details)}" if details else "")]
    if cause.startswith("answer_incomplete"):
        details = [r.incomplete_detail for r in records if r.incomplete_detail]
        return [f"{len(records)} answers were not whole" + (f": {_mode(details)}" if details else "")]
    if cause == "length:server_limit":
        tokens = sorted(output_tokens(r) for r in records)
        budget = median([float(r.requested_max_tokens) for r in records if r.requested_max_tokens])
        asked = f" though {budget:g} were requested" if budget is not None else ""
        return [f"these stopped at {_range(tokens)} output tokens{asked} (finish_reason "
                f"{_mode([r.finish_reason_raw or '?' for r in records])!r})", *_reasoning_line(records)]
    if cause in ("deadline", "idle_timeout", "client_disconnect"):
        durations = [r.duration_s for r in records]
        line = f"these lasted {_seconds_range(durations)} (median {_s(median(durations))})"
        if cause == "client_disconnect" and client_timeout_s:
            line += f"; the sweep's --timeout is {client_timeout_s:g} s"
        if cause == "idle_timeout":
            gaps = [r.itl_max_s for r in records if r.itl_max_s is not None]
            if gaps:
                line += f"; longest gap between chunks median {_s(median(gaps))}"
        return [line]
    if cause == "rejected":
        statuses = Counter(str(r.status) for r in records)
        return ["HTTP statuses: " + ", ".join(f"{k} x{v}" for k, v in statuses.most_common())]
    if cause.startswith("upstream_error"):
        kinds = Counter(r.upstream_error or "?" for r in records)
        detail = _mode([r.upstream_error_detail for r in records if r.upstream_error_detail] or ["-"])
        return ["error kinds: " + ", ".join(f"{k} x{v}" for k, v in kinds.most_common())
                + f"; most common detail: {detail[:120]}"]
    return []


def _length_onset(summaries: Sequence[LevelSummary],
                  groups: Mapping[int, Sequence[Sample]]) -> tuple[LevelSummary, Interval] | None:
    base = summaries[0]
    base_tokens = [float(output_tokens(s.record)) for s in groups[base.level]]
    for summary in summaries[1:]:
        if summary.output_tokens_mean > base.output_tokens_mean * (1 - LENGTH_DROP):
            continue
        interval = bootstrap_mean_difference(
            base_tokens, [float(output_tokens(s.record)) for s in groups[summary.level]])
        if interval is not None and interval.high < 0:
            return summary, interval
    return None


def _length_fall(summaries: Sequence[LevelSummary], groups: Mapping[int, Sequence[Sample]],
                 found: tuple[LevelSummary, Interval], latency: str) -> Verdict:
    onset, interval = found
    base = summaries[0]
    fallen = [s for s in summaries if s.level >= onset.level]
    lengths = ", ".join(f"c={s.level}: {s.output_tokens_median:g}" for s in summaries)
    length_line = (f"median output tokens by concurrency: {lengths}; mean difference c={onset.level} vs "
                   f"c={base.level}: {_interval(interval)}")
    stops = f"stop reasons stay complete: {_completion_line(summaries)}"
    durations = [s.record.duration_s for summary in fallen for s in groups[summary.level]]
    cap = median(durations)
    assert cap is not None
    tolerance = max(cap * CLUSTER_REL_TOLERANCE, CLUSTER_ABS_TOLERANCE_S)
    near = [d for d in durations if abs(d - cap) <= tolerance]
    above = [d for d in durations if d > cap + tolerance]
    clustered = (len(near) >= CLUSTER_SHARE * len(durations)
                 and len(above) <= CLUSTER_ABOVE_SHARE * len(durations))
    cluster_line = (f"{len(near)} of {len(durations)} responses at concurrency >= {onset.level} lasted "
                    f"{_seconds_range(near) if near else '-'} (median {_s(cap)}); "
                    f"at c={base.level} the median was {_s(base.duration_p50_s)}")
    if clustered:
        return Verdict(
            "hidden_cap",
            f"output shrinks from concurrency {onset.level} while every answer claims to be complete, "
            f"and durations cluster at {_s(cap)}: a server-side wall-clock cap of about {_s(cap)} "
            "returning partial text as complete",
            "wall_clock_cap", onset.level, True, (length_line, stops, cluster_line, latency,
                                                  "inferred from lengths and durations: the server "
                                                  "itself reported no truncation"),
            f"find and disclose the server's time limit (about {_s(cap)}); it cuts answers from "
            f"concurrency {onset.level}, so set capacity below that or raise the limit", interval)
    return Verdict(
        "length_shift",
        f"output shrinks from concurrency {onset.level} while stop reasons stay complete; "
        "durations do not cluster, so no cap is shown",
        None, onset.level, True, (length_line, stops, cluster_line, latency),
        "compare the answers' text across levels (batching can change generation); run more seeded "
        "repetitions to confirm", interval)


def _observed_deadline(summaries: Sequence[LevelSummary]) -> LevelSummary | None:
    base = summaries[0]
    for summary in summaries[1:]:
        if summary.deadline_hits >= MIN_CUT and summary.deadline_hits / summary.n >= 0.5 > (
                base.deadline_hits / base.n):
            return summary
    return None


def _no_load_effect(summaries: Sequence[LevelSummary], difference: Interval | None,
                    latency: str) -> Verdict:
    base, top = summaries[0], summaries[-1]
    evidence = [_completion_line(summaries), latency]
    if difference is not None:
        evidence.append(f"output tokens, mean at c={top.level} minus c={base.level}: {_interval(difference)}")
    preempted = [s for s in summaries if s.preempted_responses]
    if preempted:
        evidence.append("the server preempted during " + ", ".join(
            f"{s.preempted_responses} response(s) at c={s.level}" for s in preempted)
            + "; the answers still completed")
    kv = [s for s in summaries if s.kv_cache_usage_max is not None]
    if kv:
        evidence.append("KV cache usage max: " + ", ".join(
            f"c={s.level}: {_pct(s.kv_cache_usage_max or 0.0)}" for s in kv))
    repeats = max(2 * base.n // max(base.level, 1), 4)
    if difference is None:
        width = "that gives the length difference an interval"
    elif difference.high - difference.low == 0:
        width = (f"at c={base.level} and c={top.level} every answer had the same length, so for this seed "
                 "the difference is exact")
    else:
        spread = difference.high - difference.low
        width = f"that narrows the length difference's interval (now {spread:.1f} tokens wide)"
    return Verdict(
        "no_load_effect",
        "no load effect on completion shown: answers kept ending on their own; only latency changed",
        None, None, False, tuple(evidence),
        f"to confirm, run more seeded repetitions (e.g. --repeats {repeats}, and again with another "
        f"--seed); {width}", difference)


# --- formatting ------------------------------------------------------------------------------

def _completion_line(summaries: Sequence[LevelSummary]) -> str:
    return "completion rate by concurrency: " + ", ".join(
        f"c={s.level}: {_pct(s.completion_rate)} ({s.complete}/{s.n})" for s in summaries)


def _latency_line(base: LevelSummary, top: LevelSummary) -> str:
    return (f"TTFT p50 {_s(base.ttft_p50_s)} at c={base.level} -> {_s(top.ttft_p50_s)} at c={top.level}; "
            f"ITL p50 {_s(base.itl_p50_s)} -> {_s(top.itl_p50_s)}")


def _interval(interval: Interval) -> str:
    return (f"{interval.estimate:+.1f} tokens, {interval.confidence:.0%} CI [{interval.low:+.1f}, "
            f"{interval.high:+.1f}] ({interval.method})")


def _pct(value: float) -> str:
    return f"{value:.0%}"


def _s(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _seconds_range(values: Sequence[float]) -> str:
    return f"{_s(min(values))}-{_s(max(values))}" if values else "-"


def _range(values: Sequence[int]) -> str:
    return f"{values[0]}" if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def _mode(values: Sequence[str]) -> str:
    return Counter(values).most_common(1)[0][0]
