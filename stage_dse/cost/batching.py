"""Continuous batching with chunked prefill: the steady state of an inference engine under load.

vLLM, SGLang and TensorRT-LLM schedule per iteration (Orca, Yu et al. OSDI 2022): every engine
step runs one token for each request that is decoding plus, while prompts wait, prompt tokens up
to a budget of ``C`` tokens per step (``max_num_batched_tokens`` / ``max_num_tokens``), decode
tokens first and then prompts first-come first-served, a prompt longer than what is left split
into chunks (chunked prefill, Sarathi-Serve, Agrawal et al. OSDI 2024: "stall-free" batches).
At most ``R`` requests run at once (``max_num_seqs``), fewer if their KV cache does not fit.

**Counting** (a fluid model: rates and means per engine step). Requests complete at ``r`` per
step. A request of ``P`` prompt and ``O`` output tokens spends ``p = P / min(P, a)`` steps in
prefill, ``a`` being the budget the decoding requests leave (``a = C - d_mix``), and ``O``
steps decoding. By Little's law ``pre = r p`` requests are prefilling and ``d = r O`` decoding
on average, ``M = pre + d`` running. A fraction ``f = min(1, pre)`` of steps carries prompt
tokens, ``r P / f`` of them (several short prompts share a step: they are packed up to the
budget); when ``f < 1`` the running requests decode in the other steps (``d_dec = M``) and a
step with a prompt decodes the others (``d_mix = M - 1``); when ``f = 1`` both are ``d``.
The saturated rate is the largest ``r`` with ``M <= R`` (slot-bound) and
``r (P + O) <= C`` (token-bound: every step full).

**Step times** come from the serving program (:mod:`stage_dse.cost.serving`), same roofline
and collectives: a step with prompt tokens takes the linear layers, norms and collectives of
one packed pass of its ``q + d_mix`` tokens, the causal attention of its prompts over
themselves (a chunked prompt's chunks together cost one whole prompt's attention) and the decode
attention of its ``d_mix`` requests at context ``P + O/2``; a decode-only step is the decode
pass of ``d_dec`` requests. An engine adds per-step and per-running-request costs (scheduling,
sampling, input preparation not hidden by the engine: :mod:`stage_dse.spec.engine`), read from
the table's ``step_overhead_s`` and ``request_overhead_s`` columns when present. Mean step
``T = f T_mix + (1 - f) T_dec``; throughput ``r / T`` requests/s; TPOT is the mean over a
decoding request's steps, ``(f d_mix T_mix + (1 - f) d_dec T_dec) / d``; TTFT ``p T_mix``
plus queueing.

**Attention ranks in lock step.** An expert-parallel replica of ``n = dp`` attention ranks
steps together: every rank's tokens meet at the routed experts in each layer, so an iteration
lasts as long as its slowest rank (idle ranks run empty batches). Where the ranks admit their
prompts on their own (every engine's default; TensorRT-LLM's ``attention_dp_config.
enable_balance`` runs them together: the table's ``dp_context_sync`` column), a step carries a
prompt on some rank ``1 - (1 - f)^n`` of the time, not ``f``: in those extra steps the other
ranks wait through that rank's own part of a prompt step (``T_mix - T_dec`` less its
routed-expert work, which serves every rank's tokens and so costs its mean share only;
``serve_prefill_expert_s``, ``serve_decode_expert_s``). TensorRT-LLM's tech blog 10, "ADP
Balance Strategy", measures the loss: "the iteration time is dominated by the slowest rank".

**Load** (per row, one of):

* *saturated* (``arrival_rate = 0``, offline throughput benchmarks): the saturated rate; TTFT
  is the time from admission to the first token (no queue counted);
* *open loop* (``arrival_rate > 0``, Poisson arrivals): the running batch is the fixed point
  ``r = lambda T(r)`` (the engine completes what arrives; solved by regula falsi between no
  load and saturation), with a tagged request seeing one decoder more than the mean
  (``d + 1``: Poisson occupancy). TTFT adds the residual of the step in progress (the engine is
  busy with probability ``1 - exp(-M)``) and an M/D/1 wait against the saturated rate
  ``mu``, ``rho / (2 (1 - rho)) / mu`` (Pollaczek-Khinchine). At ``lambda >= mu`` the queue
  grows without bound: the saturated figures, TTFT infinite. At low load TPOT and TTFT tend to
  the batch-1 ones; at saturation to the saturated ones;
* *closed loop* (``clients = N``: N users each sending the next request when the last
  completes, as ``--max-concurrency`` benchmark clients do): ``M = min(N, R)`` running (and
  the token budget); the other ``N - M`` wait, ``(N - M) / X`` each by Little's law at
  throughput ``X``;
* *burst* (``burst = N`` requests sent at once, an infinite request rate): the first
  ``min(N, R)`` are prefilled together at the full budget (their first tokens spread over those
  fill steps), the rest enter as slots free at the saturated rate, and the last ``min(N, R)``
  drain with a shrinking batch (``R / 2`` on average; all ``N`` together when ``N <= R``, lengths
  being equal). Throughput is ``N O`` over that
  makespan; TTFT and TPOT are means over the ``N`` requests.

* **Speculative decoding** (multi-token prediction, DeepSeek-V3's MTP; Leviathan et al. ICML
  2023): each decode step verifies ``k`` drafted tokens; with an acceptance rate ``alpha`` per
  draft, a request gains ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens per step, so it decodes
  for ``O`` over that many steps. A verifying step runs ``k + 1`` tokens per request through
  the linear layers, reads each cache once, and drafts with ``k`` extra layers (an MTP module
  is one transformer layer); TPOT is the step time over the tokens gained.

* The KV cache caps ``R``: requests of ``P + O`` tokens that fit in the memory left after the
  weights and the working set of the widest step (``C`` tokens, or fewer when ``R`` prompts
  are shorter), within the pool the engine sizes by its own rule (:func:`kv_pool_bytes`).

* **Pipeline stages** (``pp > 1``): an engine keeps ``pp`` batches in flight, one per stage
  (vLLM's ``max_concurrent_batches``: "PP requires PP-size concurrent batches to fill the
  pipeline", ``vllm/config/vllm.py``; SGLang's and TensorRT-LLM's pipeline micro-batches
  likewise). Each is an engine of its own over ``R / pp`` of the running slots and ``1 / pp``
  of the load (arrivals, clients, a burst's requests), whose step is a whole pass through
  every stage at its batch (the serving program's time with its ``pp`` stages and their
  hops); the budget ``C`` is each batch's. The stages' throughputs add, ``pp`` times one
  batch's; TTFT and TPOT are a batch's. The KV cache per sequence is its stage's layers on
  each GPU, so each batch holds ``1 / pp`` of what fits. Unequal batches in flight (a prompt
  step beside decode-only ones) idle the other stages for the difference: not counted.

With ``C = P`` and ``R = 1`` every step is a whole prefill or a single decode, and TTFT and
TPOT are exactly the static batch-1 ones.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from stage_dse.cost.requests import LENGTH_CLASSES, mix_classes, output_length_classes
from stage_dse.cost.serving import evaluate_serving_table
from stage_dse.errors import ConfigError

__all__ = ["continuous_batching", "draft_acceptance", "held_output_tokens", "kv_pool_bytes"]

_BISECT = 60  # halvings of the saturated rate's bracket (cheap arithmetic, no evaluation)
_FIXED_POINT = 10  # regula falsi iterations of the open-loop rate (each a few evaluations)


def _array(value, n_rows: int) -> np.ndarray:
    return np.array(np.broadcast_to(np.asarray(value, dtype=float), (n_rows,)))


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.allclose(a, b, rtol=1e-12, atol=1e-12)`` without its per-call overhead (the
    fixed points below test it thousands of times per table)."""
    close = np.abs(a - b) <= 1e-12 + 1e-12 * np.abs(b)
    return bool(close.all() or (close | (a == b)).all())


def continuous_batching(
    table: pd.DataFrame,
    keys: list,
    max_running,
    prefill_budget,
    arrival_rate=0.0,
    draft_tokens=0,
    acceptance=0.0,
    mix=None,
    clients=0,
    burst=0,
    output_lengths="fixed",
    max_total_tokens=np.inf,
    **serving_options,
) -> pd.DataFrame:
    """Steady state of every serving row (see the module docstring). ``table`` and ``keys``
    as for :func:`~stage_dse.cost.serving.evaluate_serving_table` (``serving_options`` go to
    it); ``max_running`` (R, over every batch in flight), ``prefill_budget`` (C, tokens per
    step), ``arrival_rate`` (requests/s per replica; 0: saturated), ``clients`` (closed loop
    of N users; 0: none) and
    ``burst`` (N requests at once; 0: none) are scalars or arrays over the rows;
    ``draft_tokens`` and ``acceptance``: speculative decoding; ``mix``:
    ``[(prompt, output_tokens, weight), ...]`` request classes instead of the rows' own
    lengths; ``output_lengths``: ``fixed`` (every request decodes ``output_tokens``) or
    ``exponential`` (output lengths spread with that mean, prompt plus output at most
    ``max_total_tokens``: :func:`output_length_classes`)."""
    n_rows = len(table)
    if n_rows == 0:
        return pd.DataFrame(index=table.index)
    R = _array(max_running, n_rows)
    C = _array(prefill_budget, n_rows)
    lam = _array(arrival_rate, n_rows)
    users = _array(clients, n_rows)
    sent = _array(burst, n_rows)
    for name, v in (("max_running", R), ("prefill_budget", C)):
        if not np.all(v >= 1):
            raise ConfigError(f"serving.{name} must be >= 1, got {v.min():g}")
    if not np.all(lam >= 0):
        raise ConfigError(f"serving.arrival_rate must be >= 0, got {lam.min():g}")
    for name, v in (("clients", users), ("burst", sent)):
        if not np.all((v >= 0) & (v == np.round(v))):
            raise ConfigError(f"serving.{name} must be an integer >= 0, got {v.min():g}")
    if np.any((lam > 0).astype(int) + (users > 0) + (sent > 0) > 1):
        raise ConfigError(
            "serving: give one load per row: arrival_rate, clients or burst (the others 0)"
        )
    k = _array(draft_tokens, n_rows)
    alpha = _array(acceptance, n_rows)
    if not np.all((k >= 0) & (k == np.round(k))):
        raise ConfigError(f"serving.draft_tokens must be an integer >= 0, got {k.max():g}")
    if not np.all((alpha >= 0) & (alpha < 1)):
        raise ConfigError(f"serving.acceptance must be in [0, 1), got {alpha.max():g}")
    # tokens a request gains per decode step: the accepted drafts and the verifier's own
    gain = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    spread = np.broadcast_to(np.asarray(output_lengths, dtype=object), (n_rows,))
    unknown = set(spread) - {"fixed", "exponential"}
    if unknown:
        raise ConfigError(
            f"serving.output_lengths must be fixed or exponential, got {sorted(unknown)[0]!r}"
        )
    spread = spread == "exponential"
    if mix is None and spread.any():
        prompt = table["prompt"].to_numpy(float)
        cap = _array(max_total_tokens, n_rows) - prompt
        mean_out = table["output_tokens"].to_numpy(float)
        if not np.all((cap >= 2 * mean_out) | ~spread):
            raise ConfigError(
                "serving.max_total_tokens must leave at least twice output_tokens after the "
                "prompt for exponential output lengths"
            )
        # resolve the tail down to the longest of a burst's requests
        n_tail = np.maximum(np.where(sent > 0, sent, users), 2.0)
        classes = [
            (prompt, np.where(spread, o, mean_out), np.where(spread, w, 1.0 / LENGTH_CLASSES))
            for o, w in output_length_classes(mean_out, np.where(spread, cap, np.inf), n_tail)
        ]
    elif mix is None:
        classes = [(table["prompt"].to_numpy(float), table["output_tokens"].to_numpy(float), 1.0)]
    else:
        classes = mix_classes(mix, n_rows)
    step_over = _column(table, "step_overhead_s")
    replicas = table["dp"].to_numpy(float)  # attention ranks of an expert-parallel replica
    # pipeline stages: as many batches in flight, each with its share of the running slots
    stages = table["pp"].to_numpy(float)
    lanes = replicas * stages
    R = np.maximum(R / stages, 1.0)
    async_dp = (replicas > 1) & (_column(table, "dp_context_sync") == 0)
    request_over = _column(table, "request_overhead_s")
    layers = table["layers"].to_numpy(float)

    def run(rows, **columns) -> pd.DataFrame:
        """The serving program on ``rows`` with some columns set (values over all rows or
        over ``rows``)."""
        sub = table.iloc[rows].assign(
            **{c: (v[rows] if len(v) == n_rows else v) for c, v in columns.items()}
        )
        return evaluate_serving_table(sub, [keys[i] for i in rows], **serving_options)

    everyone = np.arange(n_rows)

    def mean(values) -> np.ndarray:  # over requests
        return sum(w * v for (_, _, w), v in zip(classes, values))

    prompts = [p for p, _, _ in classes]
    steps_i = [o / gain for _, o, _ in classes]  # decode steps per request
    p_mean = mean(prompts)
    steps = mean(steps_i)
    out_len = mean([o for _, o, _ in classes])
    # decoding requests, weighted by how long each class decodes: their prompt and output
    decode_prompt = mean([s * p for s, p in zip(steps_i, prompts)]) / steps
    decode_out = mean([s * o for s, (_, o, _) in zip(steps_i, classes)]) / steps
    lengths = {"prompt": decode_prompt, "output_tokens": decode_out}

    # the KV cache caps the running requests: per-sequence bytes from the decode layout,
    # memory left after the weights and the working set of the widest step
    held = held_output_tokens(decode_out, _column(table, "kv_reserve_ratio", 1.0))
    base = run(everyone, micro_batch=np.maximum(R, 1.0), prompt=decode_prompt, output_tokens=held)
    widest_tokens = np.minimum(C, R * (np.maximum.reduce(prompts) + k + 1.0))
    widest = run(everyone, micro_batch=np.ones(n_rows), prompt=widest_tokens)
    per_seq = base["serve_kv_cache_bytes"].to_numpy() / np.maximum(R, 1.0)
    pool = kv_pool_bytes(
        table, base["serve_weights_bytes"].to_numpy(), widest["serve_working_bytes"].to_numpy()
    )
    capacity = np.floor(pool / per_seq)
    slots = np.minimum(R, capacity)
    ok = slots >= 1
    slots = np.where(ok, slots, 1.0)

    def count(r, open_loop):
        """Prefill steps per class, prefilling, decoding and running requests, the fraction of
        steps with prompt tokens and the decoders of those steps and of the others, at ``r``
        completions per step (fixed point of the budget a step's decoders leave)."""
        d = r * steps
        d_mix = np.where(open_loop, d, 0.0)
        for _ in range(30):
            avail = np.maximum(C - d_mix * (k + 1.0), 1.0)
            p_i = [p / np.minimum(p, avail) for p in prompts]
            pre = r * mean(p_i)
            f = np.minimum(1.0, pre)
            closed_mix = np.maximum(0.0, d + pre - np.maximum(pre, 1.0))
            new = np.where(open_loop, d, closed_mix)
            if _close(new, d_mix):
                break
            d_mix = new
        running = pre + d
        d_dec = np.where(open_loop, d, running)
        return p_i, pre, d, running, f, d_mix, d_dec

    # the token-bound rate: every step full of prompt and decode tokens
    r_tok = C / (p_mean + steps * (k + 1.0))

    def slot_rate(limit, rows=everyone):
        """The largest rate whose running requests stay within ``limit`` (and the budget)."""
        lo, hi = np.zeros(len(rows)), r_tok[rows].copy()
        closed = np.zeros(len(rows), dtype=bool)
        fits = count_rows(rows, hi, closed)[3] <= limit[rows]
        for _ in range(_BISECT):
            mid = 0.5 * (lo + hi)
            under = count_rows(rows, mid, closed)[3] <= limit[rows]
            lo, hi = np.where(under, mid, lo), np.where(under, hi, mid)
        return np.where(fits, r_tok[rows], lo)

    att_by_prompt: dict[bytes, np.ndarray] = {}
    for p in prompts:
        if p.tobytes() not in att_by_prompt:
            att_by_prompt[p.tobytes()] = run(everyone, micro_batch=np.ones(n_rows), prompt=p)[
                "serve_prefill_attention_s"
            ].to_numpy()
    att_i = [att_by_prompt[p.tobytes()] for p in prompts]
    attention = mean(att_i)  # whole-prompt causal attention of a mean request

    def times(rows, r, open_loop, seen=0.0):
        """Step times at ``r`` completions per step on ``rows``: the mixed step, the
        decode-only step, their mean and the TPOT a decoding request sees (``seen`` decoders
        added for a tagged request under Poisson arrivals)."""
        p_i, pre, d, running, f, d_mix, d_dec = count_rows(rows, r, open_loop)
        d_mix, d_dec = d_mix + seen, np.maximum(d_dec + seen, 1.0)
        kk = k[rows]
        safe_f = np.maximum(f, 1e-300)
        q = r * p_mean[rows] / safe_f  # prompt tokens per step that has any
        mixed = run(
            rows, micro_batch=np.ones(len(rows)), prompt=np.maximum(q + d_mix * (kk + 1), 1)
        )
        dec_mix = run(rows, micro_batch=np.maximum(d_mix, 1.0), **_at(lengths, rows))
        dec = run(rows, micro_batch=d_dec, **_at(lengths, rows))
        other = (mixed["serve_ttft_s"] - mixed["serve_prefill_attention_s"]).to_numpy()
        draft_mix = kk * dec_mix["serve_tpot_s"].to_numpy() / layers[rows]
        # evaluated for at least one request, scaled to fewer (linear in the batch)
        share = np.minimum(d_mix, 1.0)
        attn_decode = share * (dec_mix["serve_decode_attention_s"].to_numpy() + draft_mix)
        prefilling = pre / safe_f  # requests whose prompt tokens ride in a mixed step
        t_mix = (
            other
            + r / safe_f * attention[rows]
            + attn_decode
            + step_over[rows]
            + request_over[rows] * (d_mix + prefilling)
        )
        t_dec = dec["serve_tpot_s"].to_numpy()
        if np.any(kk > 0):
            verify = run(rows, micro_batch=d_dec * (kk + 1), **_at(lengths, rows))
            t_dec = np.where(
                kk > 0,
                verify["serve_tpot_s"].to_numpy()
                - verify["serve_decode_attention_s"].to_numpy()
                + dec["serve_decode_attention_s"].to_numpy()
                + kk * t_dec / layers[rows],
                t_dec,
            )
        t_dec = t_dec + step_over[rows] + request_over[rows] * d_dec
        # attention ranks in lock step with their prompts unsynchronized: a step lasts as
        # long as its slowest rank, so whenever any of the n ranks runs a prompt the others
        # wait through that rank's own part of it (all but the routed experts, which serve
        # every rank's tokens and so cost the mean): t_wait, in 1 - (1 - f)^n of the steps
        n = replicas[rows]
        any_f = np.where(async_dp[rows], 1.0 - (1.0 - f) ** n, f)
        shared = np.maximum(
            mixed["serve_prefill_expert_s"].to_numpy() - dec["serve_decode_expert_s"].to_numpy(),
            0.0,
        )
        t_wait = t_dec + np.clip(t_mix - t_dec - shared, 0.0, None)
        step = f * t_mix + (any_f - f) * t_wait + (1.0 - any_f) * t_dec
        weight_mix, weight_wait = f * d_mix, (any_f - f) * d_dec
        weight_dec = (1.0 - any_f) * d_dec
        tpot = (weight_mix * t_mix + weight_wait * t_wait + weight_dec * t_dec) / np.maximum(
            weight_mix + weight_wait + weight_dec, 1e-300
        )
        tpot = tpot / gain[rows]
        names = ("p_i", "pre", "d", "running", "f", "q", "d_mix", "t_mix", "t_dec", "step", "tpot")
        values = (p_i, pre, d, running, f, q, d_mix, t_mix, t_dec, step, tpot)
        return dict(zip(names, values))

    def count_rows(rows, r, open_loop):
        full_r = np.zeros(n_rows)
        full_r[rows] = r
        flag = np.zeros(n_rows, dtype=bool)
        flag[rows] = open_loop
        out = count(full_r, flag)
        return tuple([v[rows] for v in x] if isinstance(x, list) else x[rows] for x in out)

    # saturated: as many running as the slots allow, the budget permitting
    r_sat = slot_rate(slots)
    sat = times(everyone, r_sat, np.zeros(n_rows, dtype=bool))
    mu = r_sat / sat["step"]  # requests/s per batch in flight at saturation

    r = r_sat.copy()
    res = {key: (v.copy() if isinstance(v, np.ndarray) else [x.copy() for x in v])
           for key, v in sat.items()}  # fmt: skip
    wait = np.zeros(n_rows)
    mode = np.full(n_rows, "saturated", dtype=object)

    def put(rows, got):
        for key, v in got.items():
            if isinstance(v, list):
                for dst, src in zip(res[key], v):
                    dst[rows] = src
            else:
                res[key][rows] = v

    lam_rank = lam / lanes  # arrivals per batch in flight of an attention rank
    # open loop below saturation: the fixed point of r = lambda T(r)
    below = np.flatnonzero((lam > 0) & (lam_rank < mu) & ok)
    if len(below):
        lo, hi = np.zeros(len(below)), r_sat[below].copy()
        flag = np.ones(len(below), dtype=bool)

        def h(x):
            return x - lam_rank[below] * times(below, x, flag)["step"]

        h_lo, h_hi = h(np.maximum(lo, 1e-12 * hi)), h(hi)
        side = np.zeros(len(below))
        for _ in range(_FIXED_POINT):  # Illinois regula falsi, bracket kept
            with np.errstate(divide="ignore", invalid="ignore"):
                x = np.where(h_hi != h_lo, hi - h_hi * (hi - lo) / (h_hi - h_lo), 0.5 * (lo + hi))
            x = np.clip(np.nan_to_num(x, nan=0.0), lo, hi)
            hx = h(x)
            left = hx < 0
            lo, h_lo = np.where(left, x, lo), np.where(left, hx, h_lo)
            hi, h_hi = np.where(left, hi, x), np.where(left, h_hi, hx)
            h_hi = np.where(left & (side < 0), 0.5 * h_hi, h_hi)
            h_lo = np.where(~left & (side > 0), 0.5 * h_lo, h_lo)
            side = np.where(left, -1.0, 1.0)
        x = np.where(np.abs(h_lo) < np.abs(h_hi), lo, hi)
        got = times(below, x, flag)
        # a decoding request sees the others and itself (Poisson occupancy: one more)
        got["tpot"] = times(below, x, flag, seen=1.0)["tpot"]
        put(below, got)
        r[below] = x
        rho = lam_rank[below] / mu[below]
        busy = 1.0 - np.exp(-got["running"])
        wait[below] = busy * got["step"] / 2 + rho / (2 * (1 - rho)) / mu[below]
        mode[below] = "open"
    above = (lam > 0) & ~((lam_rank < mu) & ok)
    wait[above] = np.inf
    mode[above] = "open, saturated"

    # closed loop: min(N, slots) running, the others queue
    cl = np.flatnonzero((users > 0) & ok)
    if len(cl):
        per_rank = np.maximum(users / lanes, 1.0)
        x = slot_rate(np.minimum(per_rank, slots), cl)
        got = times(cl, x, np.zeros(len(cl), dtype=bool))
        put(cl, got)
        r[cl] = x
        throughput = x / got["step"]
        waiting = np.maximum(per_rank[cl] - got["running"], 0.0)
        wait[cl] = waiting / throughput
        mode[cl] = "closed"

    t_mix, t_dec, step, tpot = res["t_mix"], res["t_dec"], res["step"], res["tpot"]
    p_bar = mean(res["p_i"])
    p_long = np.maximum.reduce(res["p_i"])
    rate = r / step  # requests/s per batch in flight
    ttft = p_bar * t_mix + wait
    ttft_long = p_long * t_mix + wait
    makespan = np.full(n_rows, np.nan)

    # burst: fill, then slots free at the saturated rate, then drain
    bu = np.flatnonzero((sent > 0) & ok)
    if len(bu):
        n_req = np.maximum(sent[bu] / lanes[bu], 1.0)
        first = np.minimum(n_req, slots[bu])
        fill_tokens = np.minimum(C[bu], first * p_mean[bu])
        fill_steps = np.maximum(first * p_mean[bu] / fill_tokens, 1.0)
        ones = np.ones(len(bu))
        filling = run(bu, micro_batch=ones, prompt=fill_tokens)
        t_fill = (
            (filling["serve_ttft_s"] - filling["serve_prefill_attention_s"]).to_numpy()
            + fill_tokens / p_mean[bu] * attention[bu]
            + step_over[bu]
            + request_over[bu] * fill_tokens / p_mean[bu]
        )
        later = n_req - first
        # the drain: requests finish class by class (shortest first), the batch shrinking to
        # the survivors; admitted over a saturated phase they are staggered (half as many on
        # average); all admitted at once they decode together
        order = np.argsort(np.stack([s[bu] for s in steps_i]), axis=0)
        s_k = np.take_along_axis(np.stack([s[bu] for s in steps_i]), order, axis=0)
        w_all = np.stack(
            [np.broadcast_to(np.asarray(w, float), (n_rows,))[bu] for _, _, w in classes]
        )
        w_k = np.take_along_axis(w_all, order, axis=0)
        surviving = np.cumsum(w_k[::-1], axis=0)[::-1]  # share still decoding in phase k
        stagger = np.where(later > 0, 0.5, 1.0)
        phase_s = np.diff(s_k, axis=0, prepend=0.0)
        t_k = []
        for k_ in range(len(classes)):
            batch_k = np.maximum(first * stagger * surviving[k_], 1.0)
            drain = run(bu, micro_batch=batch_k, **_at(lengths, bu))
            t_k.append(
                drain["serve_tpot_s"].to_numpy() + step_over[bu] + request_over[bu] * batch_k
            )
        t_k = np.stack(t_k)
        done_k = np.cumsum(phase_s * t_k, axis=0)  # decode time until class k is done
        mu_b = mu[bu]
        span = fill_steps * t_fill + later / mu_b + done_k[-1]
        # request j's prompt is done at step j P / fill_tokens (at least its own chunks)
        first_ttft = np.maximum(1.0, (first + 1.0) / 2.0 * p_mean[bu] / fill_tokens) * t_fill
        later_ttft = fill_steps * t_fill + (later + 1.0) / 2.0 / mu_b + p_bar[bu] * sat["t_mix"][bu]
        ttft[bu] = (first * first_ttft + later * later_ttft) / n_req
        ttft_long[bu] = np.where(later > 0, fill_steps * t_fill + later / mu_b, fill_steps * t_fill)
        # the first ones decode through half the fill on average, then with the others (each
        # class through the phases until it is done)
        through = np.minimum((fill_steps - 1.0) / 2.0, s_k)
        own = np.where(
            later > 0,
            sat["t_dec"][bu] * (s_k - through),
            done_k - through * t_k[0],
        )
        class_tpot = (through * t_fill + own) / np.maximum(s_k, 1e-300) / gain[bu]
        first_tpot = np.sum(w_k * class_tpot, axis=0)
        tpot[bu] = (first * first_tpot + later * sat["tpot"][bu]) / n_req
        rate[bu] = n_req / span
        makespan[bu] = span
        mode[bu] = "burst"

    gpus = table["tp"].to_numpy(float) * table["pp"].to_numpy(float) * replicas
    # fewer clients or burst requests than batches in flight (and attention ranks) leave the
    # others idle: one each, the replica's rate over those in use
    used = np.minimum(lanes, np.where(users > 0, users, np.where(sent > 0, sent, lanes)))
    requests = rate * used  # requests/s of the replica
    tokens = requests * out_len
    bound = np.where(
        ~ok,
        "kv",
        np.where(
            mode != "saturated",
            "load",
            np.where(r_sat >= r_tok * (1 - 1e-9), "tokens", np.where(slots < R, "kv", "slots")),
        ),
    )
    out = pd.DataFrame(
        {
            "cb_running": res["running"] * used / replicas,
            "cb_decode_batch": res["d"],
            "cb_chunk_tokens": res["q"],
            "cb_step_s": step,
            "cb_mixed_step_s": t_mix,
            "cb_decode_step_s": t_dec,
            "cb_ttft_s": ttft,
            "cb_ttft_longest_s": ttft_long,
            "cb_tpot_s": tpot,
            "cb_requests_per_s": requests,
            "cb_saturated_requests_per_s": mu * lanes,
            "cb_tokens_per_s": tokens,
            "cb_tokens_per_s_per_gpu": tokens / gpus,
            "cb_total_tokens_per_s_per_gpu": requests * (p_mean + out_len) / gpus,
            "cb_tokens_per_s_per_user": 1.0 / tpot,
            "cb_makespan_s": makespan,
            "cb_kv_capacity_seqs": capacity * stages,
            "cb_working_bytes": widest["serve_working_bytes"].to_numpy(),
            "cb_load": mode.astype(str),
            "cb_bound": bound.astype(str),
        },
        index=table.index,
    )
    kept = ("cb_kv_capacity_seqs", "cb_working_bytes", "cb_load", "cb_bound")
    out.loc[~ok, [c for c in out.columns if c not in kept]] = np.nan
    return out


def draft_acceptance(accepted_length: float, draft_tokens: int) -> float:
    """The per-draft acceptance rate ``alpha`` at which ``draft_tokens`` drafts per step gain
    ``accepted_length`` tokens per step on average, ``(1 - alpha^(k+1)) / (1 - alpha)`` (what
    engines report as the mean acceptance length; bisection)."""
    k = int(draft_tokens)
    if k < 1 or not 1 <= accepted_length <= k + 1:
        raise ConfigError(
            f"serving: an accepted length of {accepted_length:g} tokens per step needs "
            f"1 <= length <= draft_tokens + 1 = {k + 1}"
        )
    lo, hi = 0.0, 1.0
    for _ in range(_BISECT):
        mid = 0.5 * (lo + hi)
        gain = sum(mid**j for j in range(k + 1))
        lo, hi = (mid, hi) if gain < accepted_length else (lo, mid)
    return min(0.5 * (lo + hi), 1.0 - 1e-9)


def held_output_tokens(output_tokens, reserve_ratio):
    """Output tokens whose KV cache a running request holds, averaged over its decode: half its
    output and the engine's reserve for the other half (``EngineSpec.kv_reserve_ratio``: 1,
    the whole request reserved from admission; 0, blocks allocated as tokens arrive)."""
    return output_tokens * (1.0 + reserve_ratio) / 2.0


def _at(lengths: dict, rows) -> dict:
    return {name: v[rows] for name, v in lengths.items()}


def _column(table: pd.DataFrame, name: str, default: float = 0.0) -> np.ndarray:
    if name in table:
        values = table[name].to_numpy(float)
        return np.where(np.isnan(values), default, values)
    return np.full(len(table), default)


def kv_pool_bytes(table: pd.DataFrame, weights_bytes, working_bytes) -> np.ndarray:
    """The KV-cache pool of each row's GPU: what the weights and the working set leave of the
    usable memory, within the engine's bounds (columns from
    :meth:`~stage_dse.spec.engine.EngineSpec.kv_pool_columns`; absent, no bound):
    ``engine_memory_bytes`` holds weights, working set and cache (vLLM), ``engine_static_bytes``
    weights and cache (SGLang), and the cache takes ``kv_free_fraction`` of what is left
    (TensorRT-LLM)."""
    weights = np.asarray(weights_bytes, float)
    working = np.asarray(working_bytes, float)
    free = table["usable_memory"].to_numpy(float) - weights - working
    free = np.minimum(free, _column(table, "engine_memory_bytes", np.inf) - weights - working)
    free = np.minimum(free, _column(table, "engine_static_bytes", np.inf) - weights)
    return np.maximum(free, 0.0) * _column(table, "kv_free_fraction", 1.0)
