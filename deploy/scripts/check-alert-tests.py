#!/usr/bin/env python3
"""Checks that every alert in prometheus/rules/*.yml has a promtool unit test that shows it
firing after its `for:` and, later in the same test, resolved (an empty `exp_alerts`).

promtool only checks the expectations a test states; this checks the tests state enough.
Run by deploy/scripts/check.sh; needs PyYAML, which kubernetes-validate installs.
"""

import os
import re
import sys
from glob import glob

import yaml

UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(duration):
    """A Prometheus duration (`90s`, `1h30m`, `0`) in seconds."""
    text = str(duration)
    if text == "0":
        return 0.0
    parts = re.findall(r"(\d+)(ms|[smhdwy])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {duration!r}")
    return sum(int(n) * UNITS[u] for n, u in parts)


def alerts(rule_files):
    """Every alert rule's name and its `for:` in seconds."""
    found = {}
    for path in rule_files:
        with open(path) as f:
            for group in yaml.safe_load(f)["groups"]:
                for rule in group["rules"]:
                    if "alert" in rule:
                        found[rule["alert"]] = seconds(rule.get("for", 0))
    return found


def covered(test_files, wait):
    """Names of alerts that some test shows firing at or after their `for:` and resolved
    at a later evaluation of the same test."""
    done = set()
    for path in test_files:
        with open(path) as f:
            for test in yaml.safe_load(f)["tests"]:
                checks = test.get("alert_rule_test", [])
                for fired in checks:
                    name, t1 = fired["alertname"], seconds(fired["eval_time"])
                    if not fired.get("exp_alerts") or t1 < wait.get(name, 0):
                        continue
                    if any(c["alertname"] == name and not c.get("exp_alerts")
                           and seconds(c["eval_time"]) > t1 for c in checks):
                        done.add(name)
    return done


def main():
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    wait = alerts(sorted(glob("prometheus/rules/*.yml")))
    missing = sorted(set(wait) - covered(sorted(glob("prometheus/tests/*.yml")), wait))
    for name in missing:
        print(f"deploy-check: alert {name} has no test that shows it firing after its "
              f"for: ({wait[name]:g} s) and then resolved", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
