"""A stand-in for a cloud's instance metadata service on 127.0.0.1 (run as its own process).

    python tests/metadata_server.py --cloud aws --port 8123 --trigger /tmp/preempt-now

Until the trigger file exists it reports "no preemption"; afterwards it announces one, speaking the
real protocols: AWS IMDSv2 (token, then ``spot/instance-action``), GCP ``instance/preempted``, and
Azure Scheduled Events (``Preempt``).
"""

from __future__ import annotations

import argparse
import email.utils
import json
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOKEN = "imds-token-for-tests"


def make_handler(cloud: str, trigger: Path, lead: float = 120.0) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, code: int, body: str = "", content_type: str = "text/plain") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            if (
                cloud == "aws"
                and self.path == "/latest/api/token"
                and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            ):
                self._send(200, TOKEN)
            else:
                self._send(404)

        def do_GET(self) -> None:
            preempted = trigger.exists()
            if cloud == "aws" and self.path == "/latest/meta-data/spot/instance-action":
                if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                    self._send(401)
                elif not preempted:
                    self._send(404)
                else:
                    when = datetime.now(timezone.utc) + timedelta(seconds=lead)
                    self._send(
                        200,
                        json.dumps({"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}),
                        "application/json",
                    )
            elif cloud == "gcp" and self.path == "/computeMetadata/v1/instance/preempted":
                if self.headers.get("Metadata-Flavor") != "Google":
                    self._send(403)
                else:
                    self._send(200, "TRUE" if preempted else "FALSE")
            elif cloud == "azure" and self.path.startswith("/metadata/scheduledevents"):
                if self.headers.get("Metadata") != "true":
                    self._send(400)
                    return
                events = []
                if preempted:
                    not_before = email.utils.formatdate(time.time() + 30, usegmt=True)
                    events.append(
                        {
                            "EventId": "A1B2",
                            "EventType": "Preempt",
                            "ResourceType": "VirtualMachine",
                            "Resources": ["vm0"],
                            "EventStatus": "Scheduled",
                            "NotBefore": not_before,
                        }
                    )
                self._send(
                    200, json.dumps({"DocumentIncarnation": 1 + len(events), "Events": events}), "application/json"
                )
            else:
                self._send(404)

    return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cloud", choices=["aws", "gcp", "azure"], required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--trigger", type=Path, required=True)
    p.add_argument("--lead", type=float, default=120.0, help="AWS: seconds from the notice to its deadline")
    args = p.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.cloud, args.trigger, args.lead)).serve_forever()


if __name__ == "__main__":
    main()
