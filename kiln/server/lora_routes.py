"""LoRA over HTTP, as SGLang serves it: a request picks its adapter by lora_path (native /generate: one name, or a
list for a batch, null for the base model) or by OpenAI's model "BASE:ADAPTER"; POST /load_lora_adapter
{lora_name, lora_path} and POST /unload_lora_adapter {lora_name} change the adapters at runtime (the engine loads
between steps: running requests keep their slots); /v1/models lists each adapter with its parent.

The front keeps the names of the adapters loaded (LoraNames, updated by the load and unload answers), so that a
request naming another is refused with a 400 before it reaches the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from kiln.config import LORA_OFF, ServerArgs, lora_path_pairs
from kiln.sampling_params import InvalidParam
from kiln.server.protocol import error_body
from kiln.server.sglang_fields import adapter_named


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang's: Kiln evicts only idle adapters' slots, pinned or not


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


@dataclass
class LoraNames:
    """The adapters loaded, by name (their paths), as the front knows them; enabled False without --enable-lora."""

    enabled: bool
    paths: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, args: ServerArgs) -> LoraNames:
        return cls(args.enable_lora, dict(lora_path_pairs(args.lora_paths)) if args.enable_lora else {})

    def check(self, name: str, param: str) -> str:
        if not self.enabled:
            raise InvalidParam(param, f"{param}={name!r}: {LORA_OFF}")
        if name not in self.paths:
            loaded = ", ".join(sorted(self.paths)) or "none"
            raise InvalidParam(param, f"{param}: LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return name

    def per_prompt(self, lora_path: str | list[str | None] | None, prompts: int) -> list[str | None] | None:
        """/generate's lora_path as one adapter per prompt (None: the base model); None when no prompt has one."""
        if lora_path is None:
            return None
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * prompts
        if len(loras) != prompts:
            raise InvalidParam("lora_path", f"lora_path has {len(loras)} entries for {prompts} prompts")
        return [None if name is None else self.check(name, "lora_path") for name in loras]

    def of_model(self, asked: str | None, served: str, lora_path: str | list | None = None) -> str | None:
        """The adapter an OpenAI request names: model "<served or any base>:<adapter>", else its lora_path. A
        model name without an adapter is the base model's, whatever it says (as SGLang)."""
        adapter = adapter_named(asked, served)
        if adapter:
            return self.check(adapter, "model")
        if isinstance(lora_path, list):
            raise InvalidParam("lora_path", "lora_path of an OpenAI request is one adapter's name (or null)")
        return None if lora_path is None else self.check(lora_path, "lora_path")

    def cards(self, served: str) -> list[dict]:
        """/v1/models' cards of the adapters: id "<base>:<adapter>" (what a request names), parent the base."""
        return [
            {"id": f"{served}:{name}", "object": "model", "created": 0, "owned_by": "kiln", "root": path,
             "parent": served}
            for name, path in sorted(self.paths.items())
        ]  # fmt: skip


def add_lora_routes(app: FastAPI, names: LoraNames, parse_body, client_of) -> None:
    """POST /load_lora_adapter and /unload_lora_adapter: SGLang's answer {success, error_message,
    loaded_adapters}, a 400 naming the adapter when the engine refuses it."""

    async def control(kind: str, args: dict) -> JSONResponse:
        out = await client_of().control(kind, timeout=300.0, args=args)
        loaded = out.data.get("loaded_adapters")
        if loaded is not None:
            names.paths = {a["lora_name"]: a["lora_path"] for a in loaded}
        if not out.ok:
            error = out.data.get("error", "refused")
            body = {**error_body(error, "lora_name"), "success": False, "error_message": error}
            return JSONResponse({**body, "loaded_adapters": names.paths}, status_code=400)
        return JSONResponse({"success": True, "error_message": "", "loaded_adapters": names.paths})

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await parse_body(request, LoadLoraAdapterRequest)
        if not names.enabled:
            raise InvalidParam("lora_name", LORA_OFF)
        return await control("load_lora_adapter", {"lora_name": body.lora_name, "lora_path": body.lora_path})

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await parse_body(request, UnloadLoraAdapterRequest)
        if not names.enabled:
            raise InvalidParam("lora_name", LORA_OFF)
        return await control("unload_lora_adapter", {"lora_name": body.lora_name})
