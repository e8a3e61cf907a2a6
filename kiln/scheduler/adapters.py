"""The scheduler's side of multi-LoRA serving: a request names its adapter when it arrives (checked then), pins
the adapter's slot at admission and unpins it at its end (kiln.runner.lora.LoraManager holds the slots), and the
load / unload controls SGLang's /load_lora_adapter and /unload_lora_adapter send."""

from __future__ import annotations

from typing import Any

from kiln.config import LORA_OFF
from kiln.runner.lora import AdapterError, LoraManager
from kiln.scheduler.req import Req


class AdapterPins:
    def __init__(self, lora: LoraManager | None):
        self.lora = lora

    def name_problem(self, name: str) -> str | None:
        """Why a request cannot run on adapter `name`, or None."""
        if self.lora is None:
            return LORA_OFF
        if name not in self.lora.adapters:
            loaded = ", ".join(sorted(self.lora.adapters)) or "none"
            return f"LoRA adapter {name!r} is not loaded (loaded: {loaded})"
        return None

    def uid_of(self, name: str) -> int:
        assert self.lora is not None
        return self.lora.uid_of(name)

    def pin(self, req: Req) -> bool | None:
        """Pin the request's adapter into a slot before it is admitted: True when it holds one (or needs none),
        False when every slot is pinned by other adapters (it waits), None when its adapter was unloaded."""
        if not req.lora_uid or req.lora_slot is not None or self.lora is None:
            return True
        try:
            slot = self.lora.acquire(req.lora_uid)
        except AdapterError:
            return None
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def unpin_waiting(self, req: Req) -> None:
        """A request pinned for admission that was not admitted after all: its slot is free again (a request that
        ran before, retracted since, keeps its slot)."""
        if req.kv_len == 0 and req.table_idx is None:
            self.unpin(req)

    def unpin(self, req: Req) -> None:
        if req.lora_slot is not None and self.lora is not None:
            self.lora.release(req.lora_slot)
            req.lora_slot = None

    def retire(self, live: list[Req]) -> None:
        """After a request's end: unloaded adapters that no live request holds any more are forgotten."""
        if self.lora is not None and self.lora.retiring:
            self.lora.retire({r.lora_uid for r in live})

    def control(self, kind: str, args: dict[str, Any], live: list[Req]) -> tuple[bool, dict[str, Any]]:
        """load_lora_adapter {lora_name, lora_path} | unload_lora_adapter {lora_name}: (ok, the adapters loaded
        now, or the error). An unloaded adapter's requests already accepted (`live`) still run on it."""
        if self.lora is None:
            return False, {"error": LORA_OFF}
        name = args.get("lora_name")
        try:
            if kind == "load_lora_adapter":
                self.lora.load(str(name), str(args.get("lora_path")))
            else:
                self.lora.unload(str(name), {r.lora_uid for r in live})
        except AdapterError as e:
            return False, {"error": str(e)}
        return True, {"loaded_adapters": self.lora.listing()}

    def listing(self) -> list[dict[str, Any]]:
        return self.lora.listing() if self.lora is not None else []
