#!/usr/bin/env python3
"""Checks lb-agent/proto/*.proto against the API descriptors embedded in a
gobgpd binary (default /usr/bin/gobgpd): every message, enum, field and RPC
declared here must exist there with the same number, type and label.

Needs protoc and google/protobuf/descriptor.proto (protobuf-compiler).
Usage: lb-agent/proto/check-against-gobgpd.py [path/to/gobgpd]
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = "/usr/include"


def varint(b, i):
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if not c & 0x80:
            return r, i


def embedded_descriptor(binary, name):
    """Finds a serialized FileDescriptorProto for `name` in package apipb."""
    pat = b"\x0a" + bytes([len(name)]) + name.encode() + b"\x12\x05apipb"
    off = binary.find(pat)
    if off < 0:
        sys.exit(f"{name}: no embedded descriptor found")
    i = off
    while i < len(binary):
        tag, j = varint(binary, i)
        fn, wt = tag >> 3, tag & 7
        if not 1 <= fn <= 14 or wt not in (0, 2):
            break
        if wt == 0:
            _, j = varint(binary, j)
        else:
            n, j = varint(binary, j)
            j += n
        i = j
    return binary[off:i]


def decode(raw, msg="FileDescriptorProto"):
    out = subprocess.run(
        ["protoc", f"-I{INCLUDE}", f"--decode=google.protobuf.{msg}",
         "google/protobuf/descriptor.proto"],
        input=raw, capture_output=True, check=True)
    return parse(out.stdout.decode().splitlines())


def parse(lines):
    stack = [{}]
    for ln in lines:
        ln = ln.strip()
        if not ln:
            continue
        if ln.endswith("{"):
            d = {}
            stack[-1].setdefault(ln[:-1].strip(), []).append(d)
            stack.append(d)
        elif ln == "}":
            stack.pop()
        else:
            k, v = ln.split(":", 1)
            stack[-1].setdefault(k.strip(), []).append(v.strip().strip('"'))
    return stack[0]


def g(d, k):
    return d.get(k, [""])[0]


def index(fd):
    """Flattens a FileDescriptorProto into {key: description}."""
    out = {}

    def msg(m, prefix):
        name = f"{prefix}.{g(m, 'name')}"
        out[f"message {name}"] = ""
        for f in m.get("field", []):
            out[f"field {name}.{g(f, 'name')}"] = (
                g(f, "number"), g(f, "type"), g(f, "label"), g(f, "type_name"))
        for e in m.get("enum_type", []):
            enum(e, name)
        for n in m.get("nested_type", []):
            msg(n, name)

    def enum(e, prefix):
        name = f"{prefix}.{g(e, 'name')}"
        for v in e.get("value", []):
            out[f"enum {name}.{g(v, 'name')}"] = g(v, "number")

    for m in fd.get("message_type", []):
        msg(m, "apipb")
    for e in fd.get("enum_type", []):
        enum(e, "apipb")
    for s in fd.get("service", []):
        for r in s.get("method", []):
            out[f"rpc apipb.{g(s, 'name')}.{g(r, 'name')}"] = (
                g(r, "input_type"), g(r, "output_type"),
                g(r, "server_streaming"), g(r, "client_streaming"))
    return out


def main():
    binary = open(sys.argv[1] if len(sys.argv) > 1 else "/usr/bin/gobgpd",
                  "rb").read()
    theirs = {}
    for name in ("gobgp.proto", "attribute.proto"):
        theirs.update(index(decode(embedded_descriptor(binary, name))))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "set.pb")
        subprocess.run(["protoc", f"-I{HERE}", f"-I{INCLUDE}",
                        f"--descriptor_set_out={out}", "gobgp.proto",
                        "attribute.proto"], check=True)
        ours = {}
        for fd in decode(open(out, "rb").read(),
                         "FileDescriptorSet").get("file", []):
            ours.update(index(fd))
    bad = 0
    for key, val in sorted(ours.items()):
        if key not in theirs:
            print(f"MISSING in gobgpd: {key}")
            bad += 1
        elif theirs[key] != val:
            print(f"MISMATCH {key}: ours {val} gobgpd {theirs[key]}")
            bad += 1
    print(f"{len(ours)} declarations checked, {bad} problems")
    sys.exit(1 if bad else 0)


main()
