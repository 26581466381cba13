#!/usr/bin/env python3
"""How many of 20 chat prompts loop within 256 tokens, for each sampling setting given.

Sends each prompt to a running Hearth over its OpenAI API (greedy unless a setting says
otherwise, as the web UI's chats are) and counts the replies that loop: a reply loops when some
run of 8 words occurs in it 3 times or more. Prints one JSON line per setting and a table.

    python3 tests/anchor/loops.py --url http://127.0.0.1:8080 \
        --setting off='{}' --setting dry='{"dry_multiplier": 0.8}'
"""

import argparse
import concurrent.futures
import json
import sys
import urllib.request

PROMPTS = [
    "Write a short poem about lighthouses.",
    "What should I pack for a weekend of hiking in the mountains?",
    "Explain how a bicycle's gears work.",
    "Tell me a story about a cat who learns to swim.",
    "What are some good habits for learning a new language?",
    "Describe your ideal breakfast.",
    "How do I make bread at home?",
    "Give me three ideas for a birthday party.",
    "Why is the sky blue?",
    "Write a letter to a friend who moved abroad.",
    "What is the difference between weather and climate?",
    "List some fun things to do on a rainy day.",
    "How do plants grow from seeds?",
    "Write a short song about the sea.",
    "What makes a good team leader?",
    "Explain what a computer program is to a child.",
    "Describe a busy market in the morning.",
    "How can I sleep better at night?",
    "Tell me about the moon.",
    "Write a recipe for a simple vegetable soup.",
]

RUN_WORDS, RUN_TIMES = 8, 3


def loops(text: str) -> bool:
    words = text.split()
    seen: dict[tuple, int] = {}
    for i in range(len(words) - RUN_WORDS + 1):
        run = tuple(words[i : i + RUN_WORDS])
        seen[run] = seen.get(run, 0) + 1
        if seen[run] >= RUN_TIMES:
            return True
    return False


def ask(url: str, key: str | None, prompt: str, setting: dict, tokens: int) -> str:
    body = {"temperature": 0, "max_tokens": tokens,
            "messages": [{"role": "user", "content": prompt}], **setting}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--key", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--setting", action="append", required=True,
                    help="NAME=JSON: request fields laid over greedy decoding")
    ap.add_argument("--show", action="store_true", help="print each looping reply")
    a = ap.parse_args()
    rows = []
    for s in a.setting:
        name, _, fields = s.partition("=")
        setting = json.loads(fields or "{}")
        with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
            replies = list(pool.map(lambda p: ask(a.url, a.key, p, setting, a.tokens), PROMPTS))
        looped = [p for p, r in zip(PROMPTS, replies) if loops(r)]
        row = {"setting": name, "fields": setting, "prompts": len(PROMPTS), "looped": len(looped),
               "tokens": a.tokens, "looped_prompts": looped}
        print(json.dumps(row), flush=True)
        if a.show:
            for p, r in zip(PROMPTS, replies):
                if loops(r):
                    print(f"--- {p}\n{r}\n", file=sys.stderr)
        rows.append(row)
    print("\nsetting                 looped (of 20)")
    for r in rows:
        print(f"{r['setting']:<24}{r['looped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
