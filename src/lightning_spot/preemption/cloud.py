"""Cloud spot/preemption notices from the instance metadata services, polled in a background thread.

    notice = poll_aws("http://169.254.169.254")   # IMDSv2: token, then spot/instance-action
    notice = poll_gcp("http://metadata.google.internal")
    notice = poll_azure("http://169.254.169.254")  # Scheduled Events, EventType "Preempt"

Each returns a :class:`Notice` or ``None``; network errors propagate (the poller logs and retries).
"""

from __future__ import annotations

import email.utils
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from lightning_spot.preemption.notice import Notice

log = logging.getLogger(__name__)

DEFAULT_ENDPOINTS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
#: how long each cloud says it gives after the notice, when the notice has no time of its own
DEFAULT_GRACE_SECONDS = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}


def _request(url: str, headers: dict[str, str], method: str = "GET", timeout: float = 2.0) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


def _iso_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def poll_aws(endpoint: str, timeout: float = 2.0) -> Notice | None:
    status, token = _request(
        f"{endpoint}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}, "PUT", timeout
    )
    if status != 200:
        raise OSError(f"IMDSv2 token request failed with HTTP {status}")
    status, body = _request(
        f"{endpoint}/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": token}, timeout=timeout
    )
    if status == 404:
        return None
    if status != 200:
        raise OSError(f"spot/instance-action returned HTTP {status}")
    action = json.loads(body)
    return Notice("aws", time.time(), _iso_time(action["time"]), f"spot instance-action {action.get('action', '?')}")


def poll_gcp(endpoint: str, timeout: float = 2.0) -> Notice | None:
    status, body = _request(
        f"{endpoint}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}, timeout=timeout
    )
    if status != 200:
        raise OSError(f"instance/preempted returned HTTP {status}")
    if body.strip().upper() != "TRUE":
        return None
    now = time.time()
    return Notice("gcp", now, now + DEFAULT_GRACE_SECONDS["gcp"], "instance/preempted")


def poll_azure(endpoint: str, timeout: float = 2.0) -> Notice | None:
    status, body = _request(
        f"{endpoint}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"}, timeout=timeout
    )
    if status != 200:
        raise OSError(f"scheduledevents returned HTTP {status}")
    for event in json.loads(body).get("Events", []):
        if event.get("EventType") == "Preempt":
            parsed = email.utils.parsedate_to_datetime(event["NotBefore"]) if event.get("NotBefore") else None
            now = time.time()
            deadline = parsed.timestamp() if parsed else now + DEFAULT_GRACE_SECONDS["azure"]
            return Notice("azure", now, deadline, f"scheduled event {event.get('EventId', '?')}")
    return None


POLLERS: dict[str, Callable[[str, float], Notice | None]] = {"aws": poll_aws, "gcp": poll_gcp, "azure": poll_azure}


def detect_cloud(dmi: Path = Path("/sys/class/dmi/id")) -> str | None:
    """The cloud this machine runs on, from its DMI strings (no network), or ``None``."""
    text = " ".join(
        (dmi / name).read_text(errors="ignore")
        for name in ("sys_vendor", "product_name", "bios_vendor")
        if (dmi / name).is_file()
    ).lower()
    if "amazon" in text:
        return "aws"
    if "google" in text:
        return "gcp"
    if "microsoft" in text:
        return "azure"
    return None


class CloudPoller(threading.Thread):
    """Polls one cloud's metadata service every ``interval`` seconds until a notice arrives or ``stop()``."""

    def __init__(self, cloud: str, endpoint: str, interval: float, on_notice: Callable[[Notice], None]) -> None:
        super().__init__(name=f"lightning-spot-{cloud}-notices", daemon=True)
        self.cloud = cloud
        self.endpoint = endpoint.rstrip("/")
        self.interval = interval
        self.on_notice = on_notice
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        failures = 0
        while not self._stopped.is_set():
            try:
                notice = POLLERS[self.cloud](self.endpoint, min(2.0, self.interval))
                failures = 0
            except (OSError, ValueError, KeyError) as err:
                failures += 1
                if failures in (1, 10, 100):
                    log.warning(
                        "lightning-spot: %s preemption notices unavailable at %s (%s)", self.cloud, self.endpoint, err
                    )
                notice = None
            if notice is not None:
                self.on_notice(notice)
                return
            self._stopped.wait(self.interval)
