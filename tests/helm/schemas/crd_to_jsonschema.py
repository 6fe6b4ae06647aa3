"""Turn one version of a CustomResourceDefinition into the strict JSON schema the chart gate uses.

    python tests/helm/schemas/crd_to_jsonschema.py CRD.yaml VERSION SOURCE > GROUP/KIND_VERSION.json

CRD.yaml is the published CRD file, VERSION the served version to convert (e.g. v1), SOURCE
the text recorded in the schema's ``$comment`` (where the CRD came from: repository, tag,
path, commit). The output is the layout kubeconform reads (``{group}/{kind}_{version}.json``)
and is what scripts/helm/validate.py checks rendered objects of that kind against.

What the conversion does to the openAPIV3Schema:

* keeps the validation keywords (type, format, enum, pattern, lengths, bounds, item and
  property counts, required, items, additionalProperties maps) and defaults; drops
  descriptions;
* makes every object with ``properties`` strict (``additionalProperties: false``), as
  kubeconform's ``-strict`` and the API server's field validation do;
* pins ``apiVersion`` and ``kind``, and leaves ``metadata`` to the ObjectMeta check;
* translates the CEL rules (``x-kubernetes-validations``) it knows into JSON schema, keeping
  the rule's message as ``x-kubernetes-validation-message`` (validate.py prints it), and
  refuses a CRD with a rule it does not know, so no rule is dropped silently.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

KEEP = ("type", "format", "default", "enum", "pattern", "minLength", "maxLength", "minimum", "maximum",
        "minItems", "maxItems", "minProperties", "maxProperties", "required")  # fmt: skip
IGNORED = {"description", "x-kubernetes-list-type", "x-kubernetes-list-map-keys"}
# CEL rule -> the same constraint in JSON schema.
CEL: dict[str, dict[str, Any]] = {
    # endpointPickerRef: a Service (the default kind) needs a port.
    "self.kind != 'Service' || has(self.port)": {
        "anyOf": [{"required": ["port"]}, {"required": ["kind"], "properties": {"kind": {"not": {"const": "Service"}}}}]
    },
    # targetPorts: items are {number} only (strict), so unique items = unique port numbers.
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": {"uniqueItems": True},
}


def convert(node: dict, path: str = "") -> dict:
    out = {k: node[k] for k in KEEP if k in node}
    if "properties" in node:
        out["properties"] = {k: convert(v, f"{path}.{k}") for k, v in node["properties"].items()}
        out["additionalProperties"] = False
    elif "additionalProperties" in node:
        out["additionalProperties"] = convert(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        out["items"] = convert(node["items"], f"{path}[]")
    for rule in node.get("x-kubernetes-validations", []):
        if rule["rule"] not in CEL:
            raise SystemExit(f"{path or '.'}: no JSON-schema translation for the CEL rule {rule['rule']!r}")
        out.update(CEL[rule["rule"]])
        if rule.get("message"):
            out["x-kubernetes-validation-message"] = rule["message"]
    unknown = set(node) - set(KEEP) - IGNORED - {"properties", "additionalProperties", "items",
                                                "x-kubernetes-validations"}  # fmt: skip
    if unknown:
        raise SystemExit(f"{path or '.'}: keywords this converter does not handle: {sorted(unknown)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("crd")
    ap.add_argument("version")
    ap.add_argument("source")
    args = ap.parse_args(argv)
    crd = yaml.safe_load(open(args.crd))
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == args.version]
    schema = convert(ver["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"type": "string", "enum": [f"{group}/{args.version}"]}
    schema["properties"]["kind"] = {"type": "string", "enum": [kind]}
    schema["properties"]["metadata"] = {"type": "object"}
    doc = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": f"{group}/{kind.lower()}_{args.version}.json",
        "title": f"{kind} {group}/{args.version}",
        "$comment": f"{args.source}; openAPIV3Schema of version {args.version} as a strict JSON schema "
        "(tests/helm/schemas/crd_to_jsonschema.py, README.md next to this file).",
        **schema,
    }
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
