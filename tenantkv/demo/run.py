"""The demo's run: two tenants, an agent conversation, misses, hits, isolation, audit.

Every figure and every yes/no the demo prints comes from what just ran: times are measured,
token counts are counted, "same output" compares the generated tokens, isolation is a lookup by
the other tenant next to the owner's own lookup (the positive control), the at-rest scan reads
every file of the cache and proves itself on a planted copy first, and the audit export is
verified from its file and the public key alone, next to a tampered copy that must fail.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np
import torch

from .. import __version__
from .. import open as open_cache
from ..audit import verify_export
from ..editing import DropOldToolOutputs
from ..integrations.transformers import PrefixCache, RestoredPrefix
from ..prefix import BLOCK_TOKENS
from .agent import AgentTurnResult, agent_turn
from .conversation import Message, first_turn, second_turn, third_turn, tokens_of
from .model import FAST, FULL, Generation, build_model, greedy
from .terminal import ProgressBar, table

if TYPE_CHECKING:
    from ..api import TenantKV

TENANTS = ("acme", "globex")


@dataclass
class RequestResult:
    """One request: who sent it, how much of it came from the cache, how fast."""

    label: str
    tenant: str
    prompt_tokens: int
    restored_tokens: int
    restore_s: float  # lookup + layer-wise load and decryption of the restored prefix
    ttft_s: float  # restore + the forward pass of the uncached tokens, to the first token
    generated: list[int]
    saved_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.restored_tokens


@dataclass
class AtRestScan:
    files: int
    bytes_scanned: int
    needles: list[str]
    found: list[str]  # needles found in the cache's files (must be empty)
    control_found: list[str]  # needles found in a planted file (must be all of them)


@dataclass
class DemoReport:
    """What the demo measured and checked; ``passed`` when every check held."""

    model: str
    requests: list[RequestResult] = field(default_factory=list)
    owner_lookup: int = 0
    other_lookup: int = 0
    identical_tokens: int = 0
    compared_tokens: int = 0
    expected_restore: int = 0
    scan: AtRestScan | None = None
    usage: dict[str, dict[str, float]] = field(default_factory=dict)
    audit_records: list[str] = field(default_factory=list)
    audit_ok: bool = False
    tampered_ok: bool = True
    tampered_problems: int = 0
    agent: AgentTurnResult | None = None
    checks: list[tuple[str, bool]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(ok for _, ok in self.checks)

    def request(self, label: str) -> RequestResult:
        return next(result for result in self.requests if result.label == label)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def _speedup(hit_s: float, miss_s: float) -> str:
    """The hit's speed-up as measured (timings are reported, not checked: machines are noisy)."""
    if hit_s <= miss_s:
        return f"{miss_s / hit_s:.1f}x faster"
    return f"{hit_s / miss_s:.1f}x slower: a busy machine?"


def _serve(
    prefixes: PrefixCache,
    label: str,
    prompt: list[int],
    new_tokens: int,
    out: TextIO,
) -> RequestResult:
    """Restore the longest cached prefix, generate, and save the request's cache."""
    started = time.perf_counter()
    restored: RestoredPrefix = prefixes.restore(prompt)
    restore_s = time.perf_counter() - started
    what = (
        f"restored {restored.num_tokens:,} tokens from the encrypted store in {_ms(restore_s)}"
        if restored.hit
        else "nothing cached: full prefill"
    )
    print(f"    {what}", file=out)
    generation: Generation = greedy(
        prefixes.model,
        prompt,
        restored.cache,
        new_tokens,
        progress=ProgressBar(out, f"prefill {len(prompt) - restored.num_tokens:,} tokens"),
    )
    result = RequestResult(
        label=label,
        tenant=prefixes.namespace.tenant,
        prompt_tokens=len(prompt),
        restored_tokens=restored.num_tokens,
        restore_s=restore_s,
        ttft_s=restore_s + generation.ttft_s,
        generated=generation.tokens,
    )
    result.saved_tokens = prefixes.save(prompt + generation.tokens, generation.cache, kind="agent")
    print(
        f"    time to first token {_ms(result.ttft_s)}; generated {len(generation.tokens)} "
        f"tokens; saved {result.saved_tokens:,} new tokens (sealed per 64-token block and layer)",
        file=out,
    )
    return result


def _print_messages(messages: list[Message], out: TextIO) -> None:
    for message in messages:
        print(f"    {message.summary()}", file=out)


def _scan_at_rest(root: Path, needles: dict[str, bytes], control_dir: Path) -> AtRestScan:
    """Search every file under ``root`` for the needles; prove the search on a planted file."""
    control_dir.mkdir(parents=True, exist_ok=True)
    planted = control_dir / "planted.bin"
    planted.write_bytes(b"\x00".join(needles.values()))
    control = planted.read_bytes()
    control_found = [name for name, needle in needles.items() if needle in control]
    found: set[str] = set()
    files = 0
    scanned = 0
    for path in sorted(root.rglob("*")):
        if not path.is_file() or control_dir in path.parents:
            continue
        data = path.read_bytes()
        files += 1
        scanned += len(data)
        found.update(name for name, needle in needles.items() if needle in data)
    return AtRestScan(files, scanned, list(needles), sorted(found), control_found)


def _audit(kv: TenantKV, root: Path, report: DemoReport, out: TextIO) -> None:
    """Export acme's audit chain, verify it offline, and show that a tampered copy fails."""
    export_dir = root / "exports"
    export_dir.mkdir(exist_ok=True)
    export = export_dir / "acme-audit.jsonl"
    public_key = export_dir / "audit-public-key.pem"
    lines = list(kv.context.audit.export(kv.context.index.read, tenant="acme", fmt="jsonl"))
    export.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    with kv.context.index.read() as session:
        public_key.write_bytes(kv.context.audit.public_key_pem(session))
    # Offline: only the exported file and the public key from here on.
    with export.open("rb") as handle:
        verified = verify_export(handle, public_key.read_bytes())
    records = [json.loads(line) for line in export.read_text("utf-8").splitlines()]
    report.audit_records = [r["action"] for r in records if r.get("type") == "record"]
    report.audit_ok = verified.ok
    tampered_lines = export.read_text("utf-8").splitlines()
    first = json.loads(tampered_lines[0])
    first["actor"] = "somebody-else"  # rewrite who did it, keep the stored hash
    tampered_lines[0] = json.dumps(first, separators=(",", ":"))
    tampered = export_dir / "acme-audit-tampered.jsonl"
    tampered.write_text("\n".join(tampered_lines) + "\n", encoding="utf-8")
    with tampered.open("rb") as handle:
        tampered_report = verify_export(handle, public_key.read_bytes())
    report.tampered_ok = tampered_report.ok
    report.tampered_problems = len(tampered_report.problems)
    print(
        f"    exported acme's chain to {export.name}: {len(report.audit_records)} records "
        f"({', '.join(report.audit_records)});\n    offline verification with the public key: "
        f"{'OK' if verified.ok else 'INVALID'}",
        file=out,
    )
    print(
        f"    the same export with one record's actor rewritten: "
        f"{'OK' if tampered_report.ok else 'INVALID'} "
        f"({report.tampered_problems} problem{'' if report.tampered_problems == 1 else 's'} found)",
        file=out,
    )


def run_demo(root: Path, *, fast: bool = False, new_tokens: int = 16, out: TextIO) -> DemoReport:
    """Run the demo in ``root`` (an empty or new directory); print as it goes; return the report.

    ``fast`` uses a smaller model and conversation (for the test suite).
    """
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise FileExistsError(f"{root} is not empty; the demo needs a new cache directory")
    size = FAST if fast else FULL
    conversation_size = 8 if fast else 36
    model = build_model(size)
    params = sum(p.numel() for p in model.parameters())
    report = DemoReport(
        model=(
            f"DeepSeek-V3-style, random weights (seed 0): {size.num_layers} layers, MLA latent "
            f"{size.kv_lora_rank} + rope {size.rope_dim} ({model.dtype}), "
            f"{params / 1e6:.1f}M parameters"
        )
    )
    print(f"tenantkv {__version__} demo: encrypted, per-tenant prefix caching", file=out)
    print(f"  cache  {root} (SQLite index, local block files, master key file)", file=out)
    print(f"  model  {report.model}", file=out)

    turn1 = first_turn(conversation_size)
    turn2 = second_turn(conversation_size)
    prompt1 = tokens_of(turn1)
    with open_cache(root) as kv:
        kv.create_tenant("acme", quota_bytes=256 * 2**20, retention={"agent": "3d"})
        kv.create_tenant("globex", quota_bytes=256 * 2**20)
        acme = PrefixCache(kv, "acme", model)
        globex = PrefixCache(kv, "globex", model)
        print(f"  tenants  {', '.join(TENANTS)} (256 MiB quota each, own keys)\n", file=out)

        print(f"1. acme, turn 1 of an agent session ({len(prompt1):,} tokens)", file=out)
        _print_messages(turn1, out)
        first = _serve(acme, "acme turn 1", prompt1, new_tokens, out)
        report.requests.append(first)

        prompt2 = prompt1 + first.generated + tokens_of(turn2)
        report.expected_restore = (len(prompt1) + len(first.generated) - 1) // BLOCK_TOKENS
        report.expected_restore *= BLOCK_TOKENS
        print(
            f"\n2. acme, turn 2: the agent's reply ({len(first.generated)} tokens) and more "
            f"({len(prompt2):,} tokens)",
            file=out,
        )
        _print_messages(turn2, out)
        second = _serve(acme, "acme turn 2", prompt2, new_tokens, out)
        report.requests.append(second)

        print("\n3. globex sends acme's exact turn-2 prompt", file=out)
        other = _serve(globex, "globex, same prompt", prompt2, new_tokens, out)
        report.requests.append(other)
        # The owner's control is acme's own request for this very prompt (turn 2).
        report.owner_lookup = second.restored_tokens
        report.other_lookup = other.restored_tokens
        print(
            f"    restored for globex: {report.other_lookup:,} tokens "
            f"(for acme, the same prompt: {report.owner_lookup:,})",
            file=out,
        )
        report.compared_tokens = len(second.generated)
        report.identical_tokens = sum(
            a == b for a, b in zip(second.generated, other.generated, strict=True)
        )

        kv.update_tenant("acme", quota_bytes=512 * 2**20)  # an operator action, audited
        for tenant in TENANTS:
            usage = kv.usage(tenant)
            report.usage[tenant] = {
                "hit_tokens": usage["hit_tokens"],
                "miss_tokens": usage["miss_tokens"],
                "served_tokens": usage["served_tokens"],
                "cost_units": usage.cost_units,
                "all_miss_units": usage["miss_tokens"] + usage["served_tokens"],
            }

        print("\n4. what happened", file=out)
        print(
            table(
                ["request", "prompt", "from cache", "computed", "restore", "TTFT"],
                [
                    [
                        r.label,
                        f"{r.prompt_tokens:,}",
                        f"{r.restored_tokens:,}",
                        f"{r.computed_tokens:,}",
                        _ms(r.restore_s) if r.restored_tokens else "-",
                        _ms(r.ttft_s),
                    ]
                    for r in report.requests
                ],
            ),
            file=out,
        )
        print(
            f"    same prompt, hit vs miss: time to first token {_ms(second.ttft_s)} vs "
            f"{_ms(other.ttft_s)} ({_speedup(second.ttft_s, other.ttft_s)});\n    the "
            f"{report.compared_tokens} "
            f"generated tokens after the restore are "
            f"{report.identical_tokens}/{report.compared_tokens} identical to full prefill",
            file=out,
        )
        print(
            table(
                ["tenant", "hit tokens", "miss tokens", "cost units", "if all missed"],
                [
                    [
                        tenant,
                        f"{int(u['hit_tokens']):,}",
                        f"{int(u['miss_tokens']):,}",
                        f"{u['cost_units']:,.1f}",
                        f"{u['all_miss_units']:,.0f}",
                    ]
                    for tenant, u in report.usage.items()
                ],
            ),
            file=out,
        )
        print("    (metering: a token served from cache costs 1/50 of a computed one)", file=out)

        print("\n5. acme, turn 3 with the drop-old-tool-outputs policy on", file=out)
        turn3 = third_turn(conversation_size)
        _print_messages(turn3, out)
        parts = [(m.role, m.tokens) for m in turn1]
        parts += [("assistant", first.generated)]
        parts += [(m.role, m.tokens) for m in turn2]
        parts += [("assistant", second.generated)]
        parts += [(m.role, m.tokens) for m in turn3]
        agent = agent_turn(acme, parts, DropOldToolOutputs(keep_turns=1), new_tokens, out)
        report.agent = agent
        print(
            table(
                ["strategy", "context", "computed", "TTFT"],
                [
                    [
                        "keep everything",
                        f"{agent.history_tokens:,}",
                        f"{agent.keep_computed:,}",
                        "-",
                    ],
                    [
                        "trim the text",
                        f"{agent.trim_context:,}",
                        f"{agent.trim_computed:,}",
                        _ms(agent.trim_ttft_s),
                    ],
                    [
                        "drop+repos the cache",
                        f"{agent.edit_context:,}",
                        f"{agent.edit_computed:,}",
                        _ms(agent.edit_ttft_s),
                    ],
                ],
            ),
            file=out,
        )
        print(
            f"    drop+repos sealed {agent.edit_saved:,} tokens of new blocks on the edited "
            "prefix's own key chain (blocks before the first cut are shared with the parent);\n"
            f"    the next turn restores {agent.next_hit:,} tokens of the edited conversation",
            file=out,
        )

        print("\n6. at rest", file=out)
        layer0 = first_kv_row(acme, prompt1, model)
        needles = {
            "tool output text": turn1[-1].text.encode("utf-8")[100:164],
            "token ids (uint32)": np.asarray(prompt1[200:232], dtype="<u4").tobytes(),
            "token ids (int64)": np.asarray(prompt1[200:232], dtype="<i8").tobytes(),
            "KV latent bytes": layer0,
        }
        scan = _scan_at_rest(root, needles, root / "scan-control")
        report.scan = scan
        print(
            f"    searched {scan.files} files ({scan.bytes_scanned / 2**20:.1f} MiB: block files, "
            f"index, WAL, key file) for {len(needles)} plaintext needles: "
            f"{len(scan.found)} found" + (f" ({', '.join(scan.found)})" if scan.found else ""),
            file=out,
        )
        print(
            f"    the same search on a planted copy finds {len(scan.control_found)}/"
            f"{len(needles)} (the scan works)",
            file=out,
        )

        print("\n7. audit", file=out)
        _audit(kv, root, report, out)

    report.checks = [
        ("turn 1 is a miss", first.restored_tokens == 0),
        ("turn 1 saved its full blocks", first.saved_tokens > 0),
        (
            "turn 2 restores every full block of turn 1 and the reply",
            second.restored_tokens == report.expected_restore > 0,
        ),
        (
            "generation after the restore equals full prefill",
            report.compared_tokens > 0 and report.identical_tokens == report.compared_tokens,
        ),
        (
            "globex misses acme's prompt, which acme hits",
            report.other_lookup == 0 and report.owner_lookup > 0,
        ),
        (
            "no plaintext on disk (and the scan finds a planted copy)",
            not scan.found and len(scan.control_found) == len(needles),
        ),
        (
            "turn 3: drop+repos computes fewer tokens than trimming, for the same context",
            agent.edit_context == agent.trim_context and agent.edit_computed < agent.trim_computed,
        ),
        (
            "turn 4 restores the edited prefix",
            agent.next_hit == agent.next_expected > 0,
        ),
        ("acme's audit export verifies offline", report.audit_ok),
        ("a tampered export fails verification", not report.tampered_ok),
    ]
    print("\nchecks", file=out)
    for name, ok in report.checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {name}", file=out)
    failed = sum(not ok for _, ok in report.checks)
    print(
        "demo passed" if failed == 0 else f"demo FAILED ({failed} of {len(report.checks)} checks)",
        file=out,
    )
    return report


def first_kv_row(prefixes: PrefixCache, prompt: list[int], model: torch.nn.Module) -> bytes:
    """64 bytes of layer 0's cached latent for token 100 of ``prompt``: plaintext KV to look for.

    Recomputed with a plain forward pass, independently of what the cache stored.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=prefixes.model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt[:128]]), cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert isinstance(layer, DynamicLayer) and layer.keys is not None, "layer 0 cached nothing"
    latent = layer.keys[0, 0, 100].contiguous()
    return latent.numpy().tobytes()[:64]
