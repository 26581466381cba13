#!/usr/bin/env python3
"""Writes Hearth's Grafana dashboards (dashboards/*.json) from the panel lists below.

    python3 deploy/grafana/generate.py           # rewrite the JSON files
    python3 deploy/grafana/generate.py --check   # exit 1 if the files differ from this script

Every expression uses only metrics the code exports (DESIGN.md's list plus what the code adds);
tests/tests/dashboards.rs evaluates each one against a real Prometheus scraping a running stack.
Variables: $datasource, $instance (orchestrators), $worker (workers), and Grafana's
$__rate_interval.
"""
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
ORCH = 'instance=~"$instance"'
WORKER = 'instance=~"$worker"'
RI = "$__rate_interval"


def rate(metric, sel, by=None):
    inner = f"rate({metric}{{{sel}}}[{RI}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def quantiles(metric, sel, by="le", qs=(0.5, 0.9, 0.99), legend_prefix=""):
    extra = by.replace("le", "").strip(", ")
    return [
        (
            f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{{{sel}}}[{RI}])))",
            f"{legend_prefix}p{int(q * 100)}" + (f" {{{{{extra}}}}}" if extra else ""),
        )
        for q in qs
    ]


def target(expr, legend, ref, fmt=None):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}
    if fmt:
        t["format"] = fmt
        t["legendFormat"] = "{{le}}"
    return t


def panel(title, targets, unit="short", kind="timeseries", description="", stack=False):
    """targets: [(expr, legend)]"""
    refs = "ABCDEFGHIJ"
    p = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [
            target(e, l, refs[i], "heatmap" if kind == "heatmap" else None)
            for i, (e, l) in enumerate(targets)
        ],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
    }
    if kind == "timeseries":
        p["fieldConfig"]["defaults"]["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "stacking": {"mode": "normal" if stack else "none"},
        }
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}}
    elif kind == "heatmap":
        p["options"] = {"calculate": False, "yAxis": {"unit": unit},
                        "cellGap": 1, "color": {"scheme": "Oranges", "mode": "scheme"}}
    elif kind == "stat":
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value",
                        "graphMode": "area"}
    return p


def row(title):
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(items):
    """Two panels a line (stat panels four), rows full width."""
    out, x, y, pid = [], 0, 0, 1
    for it in items:
        it = dict(it, id=pid)
        pid += 1
        if it["type"] == "row":
            if x:
                y += 8
                x = 0
            it["gridPos"] = {"x": 0, "y": y, "w": 24, "h": 1}
            y += 1
        else:
            w = 6 if it["type"] == "stat" else 12
            h = 4 if it["type"] == "stat" else 8
            if x + w > 24:
                x = 0
                y += 8
            it["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
            x += w
            if x >= 24:
                x = 0
                y += h
        out.append(it)
    return out


def variable(name, label, query, multi=True):
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "multi": multi,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


DATASOURCE_VAR = {
    "name": "datasource",
    "label": "Data source",
    "type": "datasource",
    "query": "prometheus",
    "current": {"selected": True, "text": "Prometheus", "value": "prometheus"},
}
INSTANCE_VAR = variable("instance", "Orchestrator", "label_values(hearth_requests_total, instance)")
WORKER_VAR = variable("worker", "Worker", "label_values(hearth_worker_ready, instance)")


def dashboard(uid, title, description, variables, items, links=()):
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["hearth"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables},
        "annotations": {"list": []},
        "links": [
            {"type": "dashboards", "tags": ["hearth"], "title": "Hearth", "asDropdown": False,
             "includeVars": True, "keepTime": True}
        ],
        "panels": layout(items),
    }


def overview():
    prefix_ratio = (
        f"sum(rate(hearth_worker_prefix_cache_hits_tokens_total{{{WORKER}}}[{RI}]))"
        f" / sum(rate(hearth_worker_prefix_cache_queries_tokens_total{{{WORKER}}}[{RI}]))"
    )
    session_ratio = (
        f"sum(rate(hearth_cached_prompt_tokens_total{{{ORCH}}}[{RI}]))"
        f" / sum(rate(hearth_prompt_tokens_total{{{ORCH}}}[{RI}]))"
    )
    errors = (
        f'sum by (type, stage) (label_replace(rate(hearth_errors_total{{{ORCH}}}[{RI}]), "stage", "answer", "", "")'
        f' or label_replace(rate(hearth_generation_errors_total{{{ORCH}}}[{RI}]), "stage", "mid-stream", "", ""))'
    )
    items = [
        row("Service"),
        panel("Ready workers", [("max(hearth_workers_ready{%s})" % ORCH, "ready (orchestrator view)")],
              kind="stat", description="Workers every orchestrator can route to."),
        panel("Targets up", [('sum by (job) (up{job=~"hearth|hearth-worker"})', "{{job}}")],
              kind="stat", description="Orchestrators and workers Prometheus can scrape."),
        panel("Database reachable", [("min(hearth_database_up{%s})" % ORCH, "database up")],
              kind="stat", description="1 when every orchestrator's periodic database check succeeds."),
        panel("Requests in progress", [("sum(hearth_active_streams{%s})" % ORCH, "streams")],
              kind="stat"),
        row("Traffic"),
        panel("Request rate by route and status",
              [(rate("hearth_requests_total", ORCH, "route, status"), "{{route}} {{status}}")],
              unit="reqps"),
        panel("Errors by type", [(errors, "{{type}} ({{stage}})")], unit="reqps",
              description="Error answers by `type`, and generations that failed after they started."),
        panel("Finish reasons", [(rate("hearth_requests_finished_total", ORCH, "finish_reason"),
                                  "{{finish_reason}}")], unit="reqps", stack=True),
        panel("Rate-limit rejections", [(rate("hearth_rate_limited_total", ORCH, "limit"), "{{limit}}")],
              unit="reqps"),
        panel("Worker failovers and preemptions",
              [(rate("hearth_worker_failovers_total", ORCH), "failovers/s"),
               (rate("hearth_fair_share_preemptions_total", ORCH), "preemptions/s")],
              unit="ops", description="Generations moved to another worker after a worker failed, "
              "and replies that gave their place to a user who held none (they continue later)."),
        panel("Active sessions and streams",
              [("sum(hearth_active_sessions{%s})" % ORCH, "sessions with a reply running"),
               ("sum(hearth_active_streams{%s})" % ORCH, "generations in progress")]),
        row("Latency"),
        panel("Time to first token", quantiles("hearth_time_to_first_token_seconds", ORCH), unit="s"),
        panel("Inter-token latency (time per output token)",
              quantiles("hearth_inter_token_latency_seconds", ORCH), unit="s"),
        panel("End-to-end request latency", quantiles("hearth_request_duration_seconds", ORCH), unit="s"),
        panel("Queue time", quantiles("hearth_queue_wait_seconds", ORCH), unit="s",
              description="Time a request waited for a worker with room."),
        panel("Prefill and decode time",
              quantiles("hearth_worker_step_duration_seconds", WORKER, by="le, phase", qs=(0.5, 0.99),
                        legend_prefix="step ")
              + quantiles("hearth_request_decode_seconds", ORCH, qs=(0.5, 0.99), legend_prefix="request decode "),
              unit="s", description="Engine step time by phase (prefill, decode, mixed) and each request's "
                                    "time from first token to end."),
        row("Tokens"),
        panel("Token throughput",
              [(rate("hearth_prompt_tokens_total", ORCH), "prompt tokens/s"),
               (rate("hearth_cached_prompt_tokens_total", ORCH), "cached prompt tokens/s"),
               (rate("hearth_generated_tokens_total", ORCH), "generated tokens/s")], unit="short"),
        panel("Cache hit ratio",
              [(prefix_ratio, "prefix cache (hit / queried tokens)"),
               (session_ratio, "prompt tokens served from cache")], unit="percentunit",
              description="Worker prefix cache: rate(hits)/rate(queries); and the cached share of all prompt tokens."),
        panel("Prompt length", [(f"sum by (le) (increase(hearth_request_prompt_tokens_bucket{{{ORCH}}}[{RI}]))", "")],
              kind="heatmap", unit="short"),
        panel("Generation length",
              [(f"sum by (le) (increase(hearth_request_generation_tokens_bucket{{{ORCH}}}[{RI}]))", "")],
              kind="heatmap", unit="short"),
        row("Scheduler"),
        panel("Running and waiting requests",
              [("sum(hearth_worker_running_sequences{%s})" % WORKER, "running"),
               ("sum(hearth_worker_waiting_sequences{%s})" % WORKER, "waiting on workers"),
               ("sum(hearth_queue_depth{%s})" % ORCH, "queued in orchestrators")]),
        panel("Queue depth", [("hearth_queue_depth{%s}" % ORCH, "{{instance}}")],
              description="Requests waiting in each orchestrator for a worker with room."),
        panel("Batch size", quantiles("hearth_worker_batch_size", WORKER, qs=(0.5, 0.99))
              + [(f"sum(rate(hearth_worker_batch_size_sum{{{WORKER}}}[{RI}])) / sum(rate(hearth_worker_batch_size_count{{{WORKER}}}[{RI}]))", "mean")]),
        panel("Batch utilization", [("hearth_worker_batch_utilization{%s}" % WORKER, "{{instance}}")],
              unit="percentunit"),
        row("KV cache and workers"),
        panel("KV blocks used / total",
              [("hearth_worker_kv_blocks_used{%s}" % WORKER, "used {{instance}}"),
               ("hearth_worker_kv_blocks_total{%s}" % WORKER, "total {{instance}}")]),
        panel("KV cache usage",
              [("hearth_worker_kv_blocks_used{%s} / hearth_worker_kv_blocks_total{%s}" % (WORKER, WORKER),
                "{{instance}}")], unit="percentunit"),
        panel("Session evictions and preemptions",
              [(rate("hearth_worker_session_evictions_total", WORKER, "instance"), "evictions {{instance}}"),
               (rate("hearth_worker_preemptions_total", WORKER, "instance"), "preemptions {{instance}}")],
              unit="ops"),
        panel("Cached sessions", [("hearth_worker_cached_sessions{%s}" % WORKER, "{{instance}}")]),
        row("Processes"),
        panel("Process CPU", [(f'rate(process_cpu_seconds_total{{job=~"hearth|hearth-worker"}}[{RI}])',
                                "{{job}} {{instance}}")], unit="percentunit",
              description="CPU seconds per second (1 = one core)."),
        panel("Process memory", [('process_resident_memory_bytes{job=~"hearth|hearth-worker"}',
                                   "{{job}} {{instance}}")], unit="bytes"),
    ]
    return dashboard("hearth-overview", "Hearth / Overview",
                     "Traffic, latency, tokens, scheduling and KV cache across all orchestrators and workers.",
                     [DATASOURCE_VAR, INSTANCE_VAR, WORKER_VAR], items)


def per_worker():
    items = [
        row("Worker"),
        panel("Ready", [("hearth_worker_ready{%s}" % WORKER, "{{instance}}")], kind="stat"),
        panel("Scrape up", [('up{job="hearth-worker", %s}' % WORKER, "{{instance}}")], kind="stat"),
        panel("Requests in flight", [("hearth_worker_in_flight_requests{%s}" % WORKER, "{{instance}}")],
              kind="stat"),
        panel("Cached sessions", [("hearth_worker_cached_sessions{%s}" % WORKER, "{{instance}}")], kind="stat"),
        row("Scheduling"),
        panel("Running and waiting sequences",
              [("hearth_worker_running_sequences{%s}" % WORKER, "running {{instance}}"),
               ("hearth_worker_waiting_sequences{%s}" % WORKER, "waiting {{instance}}")]),
        panel("Batch size", quantiles("hearth_worker_batch_size", WORKER, by="le, instance", qs=(0.5, 0.99))),
        panel("Batch utilization", [("hearth_worker_batch_utilization{%s}" % WORKER, "{{instance}}")],
              unit="percentunit"),
        panel("Engine steps per second by phase",
              [(rate("hearth_worker_step_duration_seconds_count", WORKER, "instance, phase"),
                "{{phase}} {{instance}}")], unit="ops"),
        panel("Step duration by phase (prefill vs decode)",
              quantiles("hearth_worker_step_duration_seconds", WORKER, by="le, phase", qs=(0.5, 0.9, 0.99)),
              unit="s"),
        panel("Tokens per second",
              [(rate("hearth_worker_prefill_tokens_total", WORKER, "instance"), "prefill {{instance}}"),
               (rate("hearth_worker_decode_tokens_total", WORKER, "instance"), "decode {{instance}}")]),
        panel("Prefill tokens per prefill step",
              [(f"sum by (instance) (rate(hearth_worker_prefill_tokens_total{{{WORKER}}}[{RI}]))"
                f' / sum by (instance) (rate(hearth_worker_step_duration_seconds_count{{{WORKER}, phase=~"prefill|mixed"}}[{RI}]))',
                "{{instance}}")]),
        panel("Prefix cache hit ratio",
              [(f"sum by (instance) (rate(hearth_worker_prefix_cache_hits_tokens_total{{{WORKER}}}[{RI}]))"
                f" / sum by (instance) (rate(hearth_worker_prefix_cache_queries_tokens_total{{{WORKER}}}[{RI}]))",
                "{{instance}}")], unit="percentunit"),
        row("Memory"),
        panel("KV blocks used / total",
              [("hearth_worker_kv_blocks_used{%s}" % WORKER, "used {{instance}}"),
               ("hearth_worker_kv_blocks_total{%s}" % WORKER, "total {{instance}}")]),
        panel("KV bytes used / budget",
              [("hearth_worker_kv_bytes_used{%s}" % WORKER, "used {{instance}}"),
               ("hearth_worker_kv_bytes_total{%s}" % WORKER, "budget {{instance}}")], unit="bytes"),
        panel("Session evictions and preemptions",
              [(rate("hearth_worker_session_evictions_total", WORKER, "instance"), "evictions {{instance}}"),
               (rate("hearth_worker_preemptions_total", WORKER, "instance"), "preemptions {{instance}}")],
              unit="ops"),
        panel("Device memory",
              [("hearth_worker_device_memory_used_bytes{%s}" % WORKER, "used {{instance}}"),
               ("hearth_worker_device_memory_total_bytes{%s}" % WORKER, "total {{instance}}")], unit="bytes"),
        row("Process"),
        panel("Process CPU", [(f'rate(process_cpu_seconds_total{{job="hearth-worker", {WORKER}}}[{RI}])',
                                "{{instance}}")], unit="percentunit"),
        panel("Process memory", [('process_resident_memory_bytes{job="hearth-worker", %s}' % WORKER,
                                   "{{instance}}")], unit="bytes"),
    ]
    return dashboard("hearth-worker", "Hearth / Worker",
                     "One worker (or several) in detail: scheduling, engine steps, KV memory, process.",
                     [DATASOURCE_VAR, WORKER_VAR], items)


def main():
    files = {
        HERE / "dashboards" / "hearth-overview.json": overview(),
        HERE / "dashboards" / "hearth-worker.json": per_worker(),
    }
    check = "--check" in sys.argv[1:]
    stale = []
    for path, dash in files.items():
        text = json.dumps(dash, indent=2, sort_keys=True) + "\n"
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("out of date (run python3 deploy/grafana/generate.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
