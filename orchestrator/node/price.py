"""The cluster's price where it was really provisioned, on the node.

The launch side sends SkyPilot's plan as ORCH_PRICE_PER_HOUR and, beside it, ORCH_PRICES: the whole cluster's $/h in
every region SkyPilot's catalog offers the planned instance type ("<cloud>/<region>": $/h). Failover may provision
another region than the plan's, and a managed job's recovery another again; each time SkyPilot starts the task it
sets SKYPILOT_CLUSTER_INFO to where the cluster runs (cloud, region, zone). So at each start `orch node` takes the
price of that region, and the spend figures and the cost cap use it. Pure: no SkyPilot on the node.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from orchestrator.core.knobs import knob


def provisioned(env: Mapping[str, str]) -> tuple[str, str]:
    """(ORCH_PRICE_PER_HOUR for the training processes, a line saying where it comes from); ("", "") when nothing
    is known or there is nothing to change."""
    planned = env.get("ORCH_PRICE_PER_HOUR", "").strip()
    table = knob(env, "ORCH_PRICES", {})
    try:
        info = json.loads(env.get("SKYPILOT_CLUSTER_INFO") or "{}")
    except ValueError:
        return planned, ""
    if not isinstance(info, dict):
        return planned, ""
    if not table or not info.get("cloud") or not info.get("region"):
        return planned, ""
    where = f"{info['cloud']}/{info['region']}"
    if where not in table:
        if not planned:
            return "", ""
        return planned, (
            f"price: {where} is not in the launch's price table; spend uses the plan's ${float(planned):,.2f}/h"
        )
    price = float(table[where])
    said = f" (the plan said ${float(planned):,.2f}/h)" if planned and abs(float(planned) - price) > 0.005 else ""
    return f"{price:.4f}", f"price: ${price:,.2f}/h for the cluster as provisioned in {where}{said}"
