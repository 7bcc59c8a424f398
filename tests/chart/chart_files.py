"""The chart's files that are copies of other sources, and how to remake them.

`crd_template()` is the text `charts/marucache/templates/crd-marucaches.yaml`
must hold: `crds/marucache.yaml` from `spec:` on, verbatim, under a header
that gates it by `crds.enabled` and adds the release's labels and the
`crds.keep` annotation. Run `python tests/chart/chart_files.py` to rewrite it
after changing the CRD.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "marucache"
CRD_SOURCE = ROOT / "crds" / "marucache.yaml"
CRD_TEMPLATE = CHART / "templates" / "crd-marucaches.yaml"

_HEADER = """\
{{- if .Values.crds.enabled }}
# A copy of crds/marucache.yaml (from `spec:` on, verbatim): remake it with
# `python tests/chart/chart_files.py`; tests/chart fails when the two differ.
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: marucaches.maru.io
  labels:
    {{- include "marucache.labels" . | nindent 4 }}
    app.kubernetes.io/component: crd
  {{- if .Values.crds.keep }}
  annotations:
    helm.sh/resource-policy: keep
  {{- end }}
"""


def crd_spec_text() -> str:
    """The CRD source from its top-level `spec:` line to the end."""
    text = CRD_SOURCE.read_text()
    start = text.index("\nspec:\n") + 1
    return text[start:].rstrip("\n") + "\n"


def crd_template() -> str:
    return _HEADER + crd_spec_text() + "{{- end }}\n"


if __name__ == "__main__":
    CRD_TEMPLATE.write_text(crd_template())
    print(f"wrote {CRD_TEMPLATE.relative_to(ROOT)}")
