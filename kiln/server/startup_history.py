"""What startup phases really took on this host, kept as rates (seconds per GB of weights, per compiled shape, per
kernel build...) so that a start of another model or configuration can use them: a small JSON file under Kiln's
cache directory (KILN_STARTUP_HISTORY moves it), one entry per host key (CPU model or GPU, device), each rate an
exponentially weighted mean of the starts that measured it. An unreadable file is an empty history; a write goes
through a temporary file and a rename, so a reader never sees half a file."""

from __future__ import annotations

import logging
import time

from kiln.core import envs
from kiln.core.json_file import read_json_dict, write_json_atomic

logger = logging.getLogger("kiln")

VERSION = 1
# hosts kept: the least recently updated go first (one machine sees one or two keys; shared home directories more)
MAX_KEYS = 16
# weight of the newest measurement: half, so a start's rates follow a changed host (a new disk, a busier machine)
# within two starts while one outlier start moves a rate only halfway
NEW_WEIGHT = 0.5


class StartupHistory:
    def __init__(self, path: str | None = None) -> None:
        self.path = path or envs.startup_history_path()
        self.data = self._read()

    def _read(self) -> dict:
        data = read_json_dict(self.path)
        if data.get("version") != VERSION or not isinstance(data.get("hosts"), dict):
            return {"version": VERSION, "hosts": {}}
        return data

    def rates(self, key: str) -> dict[str, float]:
        entry = self.data["hosts"].get(key)
        rates = entry.get("rates") if isinstance(entry, dict) else None
        if not isinstance(rates, dict):
            return {}
        return {k: float(v) for k, v in rates.items() if isinstance(v, (int, float)) and v >= 0}

    def update(self, key: str, measured: dict[str, float]) -> None:
        """Fold one start's measured rates into the key's entry and save the file."""
        if not measured:
            return
        hosts = self.data["hosts"]
        entry = hosts.get(key) if isinstance(hosts.get(key), dict) else {}
        rates = self.rates(key)
        for name, value in measured.items():
            old = rates.get(name)
            rates[name] = round(value if old is None else (1 - NEW_WEIGHT) * old + NEW_WEIGHT * value, 4)
        counts = entry.get("starts", 0) if isinstance(entry.get("starts"), int) else 0
        hosts[key] = {"rates": rates, "starts": counts + 1, "updated": time.time()}
        for old_key in sorted(hosts, key=lambda k: hosts[k].get("updated", 0))[
            : max(0, len(hosts) - MAX_KEYS)
        ]:
            del hosts[old_key]
        self.save()

    def save(self) -> None:
        try:
            write_json_atomic(self.path, self.data, sort_keys=True)
        except OSError as e:  # a read-only cache still serves; the next prediction uses older rates
            logger.debug(f"could not save the startup history to {self.path}: {e}")
