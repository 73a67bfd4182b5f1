"""A separate program that pairs with the service and then calls it with the openai SDK.

Run as: python pairing_client.py API_URL NAME SCOPES — prints the user code on stdout, polls
until approved, then makes a Responses call and prints its JSON result as the last line.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import openai


def main() -> int:
    api, name, scopes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    with httpx.Client(base_url=api, timeout=30) as http:
        started = http.post("/pairings", json={"client_name": name, "scopes": scopes})
        started.raise_for_status()
        pairing = started.json()
        print(json.dumps({"user_code": pairing["user_code"], "id": pairing["id"]}), flush=True)
        interval = pairing["interval"]
        while True:
            time.sleep(interval)
            polled = http.post(
                f"/pairings/{pairing['id']}/token", json={"device_code": pairing["device_code"]}
            )
            if polled.status_code == 200:
                token = polled.json()
                break
            error = polled.json()["error"]["code"]
            if error == "slow_down":
                interval += 5
            elif error != "authorization_pending":
                print(json.dumps({"error": error}), flush=True)
                return 1
    with openai.OpenAI(base_url=api, api_key=token["access_token"]) as client:
        response = client.responses.create(input="Hello from a paired client", max_output_tokens=5)
    print(
        json.dumps(
            {
                "client_id": token["client_id"],
                "scopes": token["scopes"],
                "response_id": response.id,
                "status": response.status,
                "text": response.output_text,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
