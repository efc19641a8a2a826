"""Schemas of the two custom resources the deployment files use.

The published CRDs (leaderworkerset.x-k8s.io_leaderworkersets.yaml in
kubernetes-sigs/lws, inference.networking.k8s.io_inferencepools.yaml in
kubernetes-sigs/gateway-api-inference-extension) are not distributed by any
registry CI can reach, so CI checks against the schemas below, written from
the v1 API types: LWS at 060ab4d (v0.10.0 + 11), GAIE at 84436a9 (v1.6.0).
Whoever has the CRD files (`kubectl get crd NAME -o yaml` on a cluster, or
the projects' config/crd/bases/) passes them with `--crd FILE`; then every
custom resource is also validated against the CRD's own OpenAPI schema.
`check_edits` holds both to the API's verdicts on edits of the real files.

Both sides are closed: an unknown field is an error, as `kubectl apply
--validate=strict` makes it. The pod templates inside a LeaderWorkerSet are
left open here because check.py validates them as core PodTemplates.
"""

import copy

import jsonschema
import yaml

NAME = {"type": "string", "minLength": 1}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
METADATA = {"type": "object", "required": ["name"], "properties": {"name": NAME}}
INT_OR_STRING = {"type": ["integer", "string"]}


def closed(properties, required=()):
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def resource(api_version, kind, spec):
    return closed(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        required=["apiVersion", "kind", "metadata", "spec"],
    )


# leaderworkerset.x-k8s.io/v1 LeaderWorkerSetSpec (api/leaderworkerset/v1).
LWS = resource(
    "leaderworkerset.x-k8s.io/v1",
    "LeaderWorkerSet",
    closed(
        {
            "replicas": {"type": "integer", "minimum": 0, "maximum": 1000000},
            "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
            "networkConfig": closed(
                {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}},
                required=["subdomainPolicy"],
            ),
            "rolloutStrategy": closed(
                {
                    "type": {"enum": ["RollingUpdate"]},
                    "rollingUpdateConfiguration": closed(
                        {
                            "maxSurge": INT_OR_STRING,
                            "maxUnavailable": INT_OR_STRING,
                            "partition": {"type": "integer"},
                        }
                    ),
                },
                required=["type"],
            ),
            "leaderWorkerTemplate": closed(
                {
                    "size": {"type": "integer"},
                    "restartPolicy": {
                        "enum": [
                            "Default",
                            "RecreateGroupOnPodRestart",
                            "RecreateGroupAfterStart",
                            "None",
                        ]
                    },
                    "leaderTemplate": {"type": "object"},
                    "workerTemplate": {"type": "object"},
                    "subGroupPolicy": closed(
                        {
                            "subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                            "subGroupSize": {"type": "integer"},
                        }
                    ),
                    "persistentVolumeClaimRetentionPolicy": closed(
                        {"whenDeleted": {"type": "string"}, "whenScaled": {"type": "string"}}
                    ),
                    "volumeClaimTemplates": {"type": "array", "items": {"type": "object"}},
                },
                required=["workerTemplate"],
            ),
        },
        required=["leaderWorkerTemplate"],
    ),
)

# inference.networking.k8s.io/v1 InferencePoolSpec (GAIE api/v1). The CRD's
# two CEL rules are written as JSON Schema: target port numbers are unique,
# and a picker of kind Service (the default kind) names its port.
DNS_SUBDOMAIN = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
POOL = resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    closed(
        {
            "selector": closed(
                {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 64,
                        "additionalProperties": {
                            "type": "string",
                            "maxLength": 63,
                            "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
                        },
                    }
                },
                required=["matchLabels"],
            ),
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "uniqueItems": True,
                "items": closed({"number": PORT}, required=["number"]),
            },
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                **closed(
                    {
                        "group": {"type": "string", "maxLength": 253, "pattern": DNS_SUBDOMAIN},
                        "kind": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 63,
                            "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                        },
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": closed({"number": PORT}, required=["number"]),
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    required=["name"],
                ),
                "if": {"not": {"required": ["kind"], "properties": {"kind": {"not": {"const": "Service"}}}}},
                "then": {"required": ["port"]},
            },
        },
        required=["selector", "targetPorts"],
    ),
)

SCHEMAS = {"LeaderWorkerSet": LWS, "InferencePool": POOL}


def from_crd(text, version="v1"):
    """(kind, JSON Schema) of a CRD file's `version`, closed like ours.

    The OpenAPI extensions become JSON Schema: int-or-string a type union,
    preserve-unknown-fields an open object; CEL rules are not evaluated
    (the schemas here state those two rules themselves)."""
    crd = yaml.safe_load(text)
    kind = crd["spec"]["names"]["kind"]
    if kind not in SCHEMAS:
        raise ValueError(f"it defines {kind}, not one of {', '.join(SCHEMAS)}")
    served = [v for v in crd["spec"]["versions"] if v["name"] == version]
    if not served:
        names = ", ".join(v["name"] for v in crd["spec"]["versions"])
        raise ValueError(f"it defines {kind} {names}, not {version}")
    schema = _structural(served[0]["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return kind, schema


def _structural(node):
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "description"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.update(INT_OR_STRING)
    if "properties" in node:
        out["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _structural(node["additionalProperties"])
    if "items" in node:
        out["items"] = _structural(node["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [_structural(n) for n in node[key]]
    return out


def _set(doc, path, value):
    """A copy of `doc` with `path` (dot-separated) set to `value`; None removes it."""
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[key]
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return doc


# Edits of a real file's resource and whether the API accepts each, read
# from the CRD; CEL marks a verdict that comes from one of the CRD's CEL
# rules, which `from_crd` schemas do not evaluate.
OK, BAD, CEL = "accepts", "refuses", "refuses (CEL)"
EDITS = {
    "LeaderWorkerSet": [
        ("spec.replicas", -1, BAD),
        ("spec.replicas", 1000001, BAD),
        ("spec.startupPolicy", "LeaderReady", OK),
        ("spec.startupPolicy", "Leader", BAD),
        ("spec.networkConfig", {"subdomainPolicy": "UniquePerReplica"}, OK),
        ("spec.networkConfig", {}, BAD),
        ("spec.rolloutStrategy", {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxSurge": "25%"}}, OK),
        ("spec.rolloutStrategy", {"type": "Recreate"}, BAD),
        ("spec.leaderWorkerTemplate.size", "2", BAD),
        ("spec.leaderWorkerTemplate.restartPolicy", "RecreateGroupAfterStart", OK),
        ("spec.leaderWorkerTemplate.restartPolicy", "Always", BAD),
        ("spec.leaderWorkerTemplate.subGroupPolicy", {"subGroupSize": 2}, OK),
        ("spec.leaderWorkerTemplate.subGroupPolicy", {"subGroupPolicyType": "Leader"}, BAD),
        ("spec.leaderWorkerTemplate.workerTemplate", None, BAD),
        ("spec.leaderWorkerTemplate.groupSize", 2, BAD),
        ("spec.size", 2, BAD),
    ],
    "InferencePool": [
        ("spec.appProtocol", "kubernetes.io/h2c", OK),
        ("spec.appProtocol", "grpc", BAD),
        ("spec.targetPorts", [], BAD),
        ("spec.targetPorts", [{"number": 8000 + i} for i in range(9)], BAD),
        ("spec.targetPorts", [{"number": 8000}, {"number": 8000}], CEL),
        ("spec.targetPorts", [{"number": 0}], BAD),
        ("spec.targetPorts", [{"number": 8000, "name": "http"}], BAD),
        ("spec.selector", {"matchLabels": {"app": "-host"}}, BAD),
        ("spec.selector", {"matchLabels": {}}, BAD),
        ("spec.selector", {}, BAD),
        ("spec.endpointPickerRef", None, OK),
        ("spec.endpointPickerRef", {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"}, OK),
        ("spec.endpointPickerRef", {"name": "epp", "port": {"number": 9002}, "failureMode": "Open"}, BAD),
        ("spec.endpointPickerRef", {"name": "", "port": {"number": 9002}}, BAD),
        ("spec.endpointPickerRef", {"name": "epp"}, CEL),
        ("spec.endpointPickerRef", {"name": "epp", "kind": "Service"}, CEL),
        ("spec.endpointPickerRef", {"name": "epp", "kind": "Endpoints", "group": "example.com"}, OK),
        ("spec.endpointPickerRef", {"name": "epp", "kind": "Pod-", "port": {"number": 9002}}, BAD),
        ("spec.endpointPickerRef", {"name": "epp", "group": "Example.com", "port": {"number": 9002}}, BAD),
        ("spec.endpointPickerRef", {"port": {"number": 9002}}, BAD),
        ("spec.modelServers", {}, BAD),
    ],
}


def check_edits(kind, doc, crd_schema=None):
    """Every edit of `doc` gets the API's verdict from the schema here and,
    given the CRD's schema, from that too (except for CEL verdicts, which
    the CRD schema, evaluated without CEL, would accept)."""
    for path, value, verdict in EDITS[kind]:
        edited = _set(doc, path, value)
        expect = verdict == OK
        assert _valid(SCHEMAS[kind], edited) == expect, (
            f"{kind}: the API {verdict} {path} = {value!r}, the schema here does not"
        )
        if crd_schema is not None:
            expect_crd = verdict != BAD
            assert _valid(crd_schema, edited) == expect_crd, (
                f"{kind}: the CRD's schema {'refuses' if expect_crd else 'accepts'} {path} = {value!r}"
            )
    return len(EDITS[kind])


def _valid(schema, doc):
    try:
        jsonschema.validate(doc, schema)
        return True
    except jsonschema.ValidationError:
        return False
