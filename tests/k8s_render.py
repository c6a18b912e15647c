"""A renderer for the subset of kustomize that `deploy/k8s` uses, for tests only.

No kustomize binary is available to the test suite, so this module renders a
kustomization directory the way `kustomize build` would, for exactly these
features and nothing else:

- `resources`: YAML files (one or more documents) and directories holding a
  `kustomization.yaml`, rendered recursively;
- `namespace`: set on every namespaced object (a `Namespace` object is left as is);
- `images`: `name` matched against container and init-container images of pod
  templates, replaced by `newName`, `newTag` and/or `digest`;
- `labels` with `includeSelectors: false` (`includeTemplates` honoured): added to
  every object's metadata and, with `includeTemplates`, to pod templates;
- `patches`: strategic-merge patches (inline `patch` or `path`) made only of
  mappings and scalars, such as a Deployment's `spec.replicas`, applied to the
  object named by `target` (kind and name) or by the patch itself;
- `secretGenerator` with `literals` only, together with
  `generatorOptions.disableNameSuffixHash: true` (so no name hashing and no
  reference rewriting is needed).

Anything else (another field, `commonLabels`, a list inside a patch, a generator
from files, name-suffix hashing, an unknown kind...) raises `Unsupported`
rather than being rendered wrongly.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Unsupported", "render"]

Manifest = dict[str, Any]

SUPPORTED_FIELDS = frozenset(
    {
        "apiVersion",
        "kind",
        "resources",
        "namespace",
        "images",
        "labels",
        "patches",
        "secretGenerator",
        "generatorOptions",
    }
)
CLUSTER_SCOPED_KINDS = frozenset({"Namespace"})
NAMESPACED_KINDS = frozenset({"ConfigMap", "Secret", "Service", "Deployment", "Job"})
WORKLOAD_KINDS = frozenset({"Deployment", "Job"})


class Unsupported(Exception):
    """The kustomization uses something this renderer does not implement."""


def render(directory: Path) -> list[Manifest]:
    """Render the kustomization in `directory` into a list of manifests.

    Raises:
        Unsupported: the kustomization uses a feature outside the subset.
        FileNotFoundError: a listed resource does not exist.
    """
    kustomization = _load_kustomization(directory)
    manifests: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        manifests.extend(_load_resource(directory, entry))
    manifests.extend(_generate_secrets(kustomization))
    for patch in kustomization.get("patches", []):
        _apply_patch(directory, patch, manifests)
    if "namespace" in kustomization:
        _set_namespace(manifests, kustomization["namespace"])
    for label_set in kustomization.get("labels", []):
        _add_labels(manifests, label_set)
    for image in kustomization.get("images", []):
        _set_image(manifests, image)
    _refuse_duplicates(manifests)
    return manifests


def _load_kustomization(directory: Path) -> Manifest:
    path = directory / "kustomization.yaml"
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise Unsupported(f"{path}: not a mapping")
    unknown = set(data) - SUPPORTED_FIELDS
    if unknown:
        raise Unsupported(f"{path}: fields not implemented: {sorted(unknown)}")
    if data.get("kind", "Kustomization") != "Kustomization":
        raise Unsupported(f"{path}: kind {data['kind']!r}")
    return data


def _load_resource(directory: Path, entry: str) -> list[Manifest]:
    if "://" in entry or entry.startswith("github.com/"):
        raise Unsupported(f"remote resource {entry!r}")
    path = (directory / entry).resolve()
    if path.is_dir():
        return render(path)
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for doc in documents:
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if kind not in NAMESPACED_KINDS | CLUSTER_SCOPED_KINDS:
            raise Unsupported(f"{path}: kind {kind!r}")
    return documents


def _generate_secrets(kustomization: Mapping[str, Any]) -> list[Manifest]:
    generators = kustomization.get("secretGenerator", [])
    options = kustomization.get("generatorOptions", {})
    if set(options) - {"disableNameSuffixHash"}:
        raise Unsupported(f"generatorOptions {sorted(options)}")
    if generators and options.get("disableNameSuffixHash") is not True:
        raise Unsupported("name-suffix hashing of generated Secrets")
    secrets = []
    for generator in generators:
        if set(generator) - {"name", "type", "literals"}:
            raise Unsupported(f"secretGenerator fields {sorted(generator)}")
        data = {}
        for literal in generator.get("literals", []):
            key, sep, value = literal.partition("=")
            if not sep:
                raise Unsupported(f"literal without '=': {literal!r}")
            data[key] = base64.b64encode(value.encode()).decode()
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": generator["name"]},
                "type": generator.get("type", "Opaque"),
                "data": data,
            }
        )
    return secrets


def _apply_patch(directory: Path, entry: Mapping[str, Any], manifests: list[Manifest]) -> None:
    if set(entry) - {"patch", "path", "target"}:
        raise Unsupported(f"patch fields {sorted(entry)}")
    text = entry["patch"] if "patch" in entry else (directory / entry["path"]).read_text()
    patch = yaml.safe_load(text)
    if not isinstance(patch, dict):
        raise Unsupported("a patch that is not one mapping (JSON 6902?)")
    target = entry.get("target", {})
    if set(target) - {"kind", "name"}:
        raise Unsupported(f"patch target fields {sorted(target)}")
    kind = target.get("kind", patch.get("kind"))
    name = target.get("name", patch.get("metadata", {}).get("name"))
    matches = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    if not matches:
        raise Unsupported(f"patch target {kind}/{name} not found")
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
    for manifest in matches:
        _merge_mapping(manifest, body, where=f"{kind}/{name}")


def _merge_mapping(into: dict[str, Any], patch: Mapping[str, Any], where: str) -> None:
    for key, value in patch.items():
        if key.startswith("$"):
            raise Unsupported(f"{where}: patch directive {key}")
        if isinstance(value, list):
            raise Unsupported(f"{where}: list merging under {key!r}")
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict):
            existing = into.get(key)
            if not isinstance(existing, dict):
                existing = into[key] = {}
            _merge_mapping(existing, value, where=f"{where}.{key}")
        else:
            into[key] = value


def _set_namespace(manifests: Iterable[Manifest], namespace: str) -> None:
    for manifest in manifests:
        if manifest["kind"] not in CLUSTER_SCOPED_KINDS:
            manifest["metadata"]["namespace"] = namespace


def _add_labels(manifests: Iterable[Manifest], label_set: Mapping[str, Any]) -> None:
    if set(label_set) - {"pairs", "includeSelectors", "includeTemplates"}:
        raise Unsupported(f"labels fields {sorted(label_set)}")
    if label_set.get("includeSelectors", False):
        raise Unsupported("labels with includeSelectors (selector rewriting)")
    pairs = dict(label_set["pairs"])
    for manifest in manifests:
        manifest["metadata"].setdefault("labels", {}).update(pairs)
        if label_set.get("includeTemplates", False) and manifest["kind"] in WORKLOAD_KINDS:
            template_meta = manifest["spec"]["template"].setdefault("metadata", {})
            template_meta.setdefault("labels", {}).update(pairs)


def _set_image(manifests: Iterable[Manifest], image: Mapping[str, Any]) -> None:
    if set(image) - {"name", "newName", "newTag", "digest"}:
        raise Unsupported(f"images fields {sorted(image)}")
    for manifest in manifests:
        if manifest["kind"] not in WORKLOAD_KINDS:
            continue
        pod = manifest["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            name, tag, digest = _split_image(container["image"])
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            if "digest" in image:
                container["image"] = f"{name}@{image['digest']}"
            elif "newTag" in image:
                container["image"] = f"{name}:{image['newTag']}"
            else:
                suffix = f"@{digest}" if digest else (f":{tag}" if tag else "")
                container["image"] = name + suffix


def _split_image(reference: str) -> tuple[str, str | None, str | None]:
    """`name[:tag][@digest]` → (name, tag, digest); a registry port is not a tag."""
    rest, _, digest = reference.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon + 1 :], digest or None
    return rest, None, digest or None


def _refuse_duplicates(manifests: Iterable[Manifest]) -> None:
    seen: set[tuple[str, str | None, str]] = set()
    for manifest in manifests:
        meta = manifest["metadata"]
        key = (manifest["kind"], meta.get("namespace"), meta["name"])
        if key in seen:
            raise Unsupported(f"duplicate object {key}")
        seen.add(key)
