"""`make batch`: runs the batch runner (scripts/clients/run_batch.py) on the shipped example, 288 support tickets of a
fictional shop to triage, all under one long shared system message (the prefix cache's case). Uses the OpenAI front
that answers at --url, else starts tritonserver and the front for the run, as `make demo` does. Writes
build/batch-example.jsonl (and build/batch-example.errors.jsonl when a line fails), prints the summary and the first
answers.

    python -m scripts.clients.batch_example [--url http://127.0.0.1:9000] [--regenerate]

--regenerate rewrites the example file (scripts/clients/batch_example.jsonl) from the templates below instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from contextlib import contextmanager
from pathlib import Path

from scripts.clients import run_batch
from scripts.launcher.openai_server import answers_200, running_openai_api
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, default_model_dir

EXAMPLE = Path(__file__).resolve().parent / "batch_example.jsonl"
OUTPUT = BUILD_DIR / "batch-example.jsonl"
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the served model id: build/model/llm_settings.json's model_name

SYSTEM = (
    "You are the support triage assistant of Brightleaf Home, an online shop that sells small kitchen appliances, "
    "lamps and home electronics. Each message you receive is one customer ticket. Read it and decide two things. "
    "First, its category: billing (payments, double charges, refunds, invoices), delivery (late, lost or damaged "
    "parcels, wrong addresses), product (a device that is faulty, broken, missing parts or hard to use), account "
    "(logging in, passwords, email changes, deleting an account) or other (anything else, such as questions about "
    "gift cards or opening hours). Second, its urgency from 1 to 5: 1 is a question that can wait a week, 3 is a "
    "problem that blocks the customer, 5 is a safety risk (smoke, sparks, burns) or money taken twice. An angry tone "
    "alone does not raise the urgency; the facts do. Answer with one JSON object and nothing else, for example "
    '{"category": "delivery", "urgency": 2}. Do not greet the customer, do not apologise and do not explain.'
)
PRODUCTS = ["kettle", "toaster", "desk lamp", "coffee grinder", "blender", "smart plug", "air fryer", "radio"]
PROBLEMS = [  # each fits one category; the tone templates put them in a sentence
    "was charged twice for the {product}",
    "still have not received the refund for the {product} I sent back",
    "need an invoice with my company name for the {product}",
    "ordered the {product} ten days ago and it has not arrived",
    "got the {product} in a crushed box and it rattles",
    "had the {product} delivered to my old address",
    "find that the {product} stopped working after two days",
    "smelled smoke from the {product} the first time I used it",
    "cannot find the power cable that should come with the {product}",
    "cannot log in to see my order of the {product}",
    "never get the password reset email, and I want to review the {product}",
    "would like to know if the {product} comes in a gift box",
]
TONES = [
    "Hello, I {problem}. Could you help me, please? Thank you.",
    "This is the third time I write: I {problem}. Fix it today or I go elsewhere!",
    "hi, i {problem}. what now?",
]
TRIAGE_SCHEMA = {
    "type": "object",
    "properties": {"category": {"enum": ["billing", "delivery", "product", "account", "other"]},
                   "urgency": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["category", "urgency"],
    "additionalProperties": False,
}


def example_lines() -> list[dict]:
    """product x problem x tone, in that nesting; every third line asks for the triage schema."""
    lines = []
    for number, (product, problem, tone) in enumerate(itertools.product(PRODUCTS, PROBLEMS, TONES), 1):
        ticket = tone.format(problem=problem.format(product=product))
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ticket}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 48, "temperature": 0}
        if number % 3 == 0:
            schema = {"name": "triage", "schema": TRIAGE_SCHEMA}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        lines.append({"custom_id": f"ticket-{number:04d}", "method": "POST", "url": "/v1/chat/completions",
                      "body": body})
    return lines


def regenerate(path: Path = EXAMPLE) -> None:
    path.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in example_lines()))
    print(f"wrote {path}: {len(example_lines())} lines, {path.stat().st_size // 1024} KiB")


@contextmanager
def openai_front(url: str):
    """url when its /health/ready answers 200, else a tritonserver and the front started for the block."""
    if answers_200(f"{url}/health/ready"):
        print(f"using the server at {url}", flush=True)
        yield url
        return
    log_dir = BUILD_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"no server at {url}: starting tritonserver and the OpenAI front (logs: {log_dir}/batch-*.log) ...",
          flush=True)
    with running_server(log_path=log_dir / "batch-server.log") as ports:
        with running_openai_api(f"127.0.0.1:{ports.grpc}", default_model_dir(), log_dir / "batch-openai.log") as api:
            print(f"ready: {api}", flush=True)
            yield api


def print_first_answers(output: Path, count: int = 3) -> None:
    tickets = {line["custom_id"]: line["body"]["messages"][-1]["content"]
               for line in map(json.loads, EXAMPLE.read_text().splitlines())}
    records = sorted((json.loads(raw) for raw in output.read_text().splitlines()), key=lambda r: r["custom_id"])
    for record in records[:count]:
        answer = record["response"]["body"]["choices"][0]["message"]["content"]
        print(f"\n[{record['custom_id']}] {tickets[record['custom_id']]}\n  -> {answer}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:9000", help="an OpenAI front to use when it answers")
    parser.add_argument("--regenerate", action="store_true", help=f"rewrite {EXAMPLE.name} and exit")
    args = parser.parse_args(argv)
    if args.regenerate:
        regenerate()
        return 0
    with openai_front(args.url.rstrip("/")) as url:
        code = run_batch.main(["-i", str(EXAMPLE), "-o", str(OUTPUT), "--url", url, "--overwrite"])
    errors = run_batch.errors_path(OUTPUT)
    print(f"answers: {OUTPUT}" + (f"; errors: {errors}" if errors.exists() else ""))
    if OUTPUT.exists():
        print_first_answers(OUTPUT)
    return code


if __name__ == "__main__":
    sys.exit(main())
