"""Strict validation of the rendered objects kubernetes-validate has no schema for.

Usage: validate-custom-kinds.py CRD_FILE RENDERED_FILE...

- LoadBalancerPool (xlb.dev): against the openAPIV3Schema of our own CRD
  file, with unknown fields rejected (the API server would silently prune
  them, which hides typos in values).
- ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1): against the
  subset of prometheus-operator's API this chart uses, written down below
  from its API reference (its CRDs are not available offline). Fields the
  chart does not render are rejected, so a new one has to be added here
  deliberately.

Any other kind is an error here: the caller passes only objects
kubernetes-validate could not check. Exit status 1 on any error.
"""

import copy
import sys

import jsonschema
import yaml

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253},
        "namespace": {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 63},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}


def closed(properties, required=()):
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": list(required),
    }


DURATION = {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"}

SERVICE_MONITOR_SPEC = closed(
    {
        "selector": closed({"matchLabels": STRING_MAP}, ["matchLabels"]),
        "namespaceSelector": closed(
            {"matchNames": {"type": "array", "items": {"type": "string"}}}
        ),
        "endpoints": {
            "type": "array",
            "minItems": 1,
            "items": closed(
                {
                    "port": {"type": "string"},
                    "path": {"type": "string", "pattern": "^/"},
                    "interval": DURATION,
                    "relabelings": {
                        "type": "array",
                        "items": closed(
                            {
                                "sourceLabels": {
                                    "type": "array",
                                    "items": {"type": "string"},
                                },
                                "targetLabel": {"type": "string"},
                            }
                        ),
                    },
                },
                ["port"],
            ),
        },
    },
    ["selector", "endpoints"],
)

PROMETHEUS_RULE_SPEC = closed(
    {
        "groups": {
            "type": "array",
            "minItems": 1,
            "items": closed(
                {
                    "name": {"type": "string", "minLength": 1},
                    "rules": {
                        "type": "array",
                        "minItems": 1,
                        "items": closed(
                            {
                                "alert": {
                                    "type": "string",
                                    "pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
                                },
                                "expr": {"type": "string", "minLength": 1},
                                "for": DURATION,
                                "labels": STRING_MAP,
                                "annotations": STRING_MAP,
                            },
                            ["alert", "expr"],
                        ),
                    },
                },
                ["name", "rules"],
            ),
        }
    },
    ["groups"],
)


def strict(schema):
    """An OpenAPI v3 structural schema with unknown fields rejected: every
    object that lists its properties gets additionalProperties: false."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def object_schema(api_version, kind, spec_schema):
    return closed(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec_schema,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


def crd_schemas(crd_file):
    schemas = {}
    with open(crd_file) as f:
        for crd in yaml.safe_load_all(f):
            if not crd:
                continue
            group = crd["spec"]["group"]
            kind = crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                api_version = f"{group}/{version['name']}"
                schema = strict(version["schema"]["openAPIV3Schema"])
                # The generated schema leaves apiVersion, kind and metadata open.
                schema["properties"]["metadata"] = METADATA
                schema["properties"]["apiVersion"] = {"const": api_version}
                schema["properties"]["kind"] = {"const": kind}
                schema["required"] = sorted(
                    set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"}
                )
                schemas[(api_version, kind)] = schema
    return schemas


def main():
    crd_file, *rendered = sys.argv[1:]
    schemas = crd_schemas(crd_file)
    schemas[("monitoring.coreos.com/v1", "ServiceMonitor")] = object_schema(
        "monitoring.coreos.com/v1", "ServiceMonitor", SERVICE_MONITOR_SPEC
    )
    schemas[("monitoring.coreos.com/v1", "PrometheusRule")] = object_schema(
        "monitoring.coreos.com/v1", "PrometheusRule", PROMETHEUS_RULE_SPEC
    )
    errors = 0
    checked = 0
    for path in rendered:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if not doc:
                    continue
                key = (doc.get("apiVersion"), doc.get("kind"))
                name = f"{key[1]}/{doc.get('metadata', {}).get('name')}"
                schema = schemas.get(key)
                if schema is None:
                    print(f"{path}: {name}: no schema for {key[0]} {key[1]}")
                    errors += 1
                    continue
                validator = jsonschema.Draft7Validator(
                    schema, format_checker=jsonschema.FormatChecker()
                )
                for error in sorted(validator.iter_errors(doc), key=str):
                    where = ".".join(str(p) for p in error.absolute_path) or "(object)"
                    print(f"{path}: {name}: {where}: {error.message}")
                    errors += 1
                checked += 1
    print(f"{checked} objects of custom kinds checked, {errors} errors")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
