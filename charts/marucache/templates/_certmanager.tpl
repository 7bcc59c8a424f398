{{/*
The webhook's certificate from cert-manager (webhook.tls.mode "certManager"):
a serving Certificate into the Secret the operator mounts, signed by
webhook.tls.certManager.issuerRef, or, without one, by a CA of the release's
own (a self-signed Issuer signs a CA Certificate; a CA Issuer signs with it).
*/}}
{{- define "marucache.webhook.certName" -}}
{{- printf "%s-webhook" (include "marucache.operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "marucache.webhook.certManager" -}}
{{- $service := include "marucache.operator.fullname" . }}
{{- $host := include "marucache.webhook.host" . }}
{{- $cm := .Values.webhook.tls.certManager }}
{{- $issuer := $cm.issuerRef | default dict }}
{{- if and $issuer (not $issuer.name) }}
{{- fail "webhook.tls.certManager.issuerRef needs a name (and kind Issuer or ClusterIssuer), or leave it empty for a CA of the release's own" }}
{{- end }}
{{- $ca := printf "%s-ca" $service | trunc 63 | trimSuffix "-" }}
{{- if not $issuer }}
{{- $selfSigned := printf "%s-selfsigned" $service | trunc 63 | trimSuffix "-" }}
apiVersion: cert-manager.io/v1
kind: Issuer
metadata:
  name: {{ $selfSigned }}
  namespace: {{ .Release.Namespace }}
  labels:
    {{- include "marucache.labels" . | nindent 4 }}
    app.kubernetes.io/component: webhook
spec:
  selfSigned: {}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ $ca }}
  namespace: {{ .Release.Namespace }}
  labels:
    {{- include "marucache.labels" . | nindent 4 }}
    app.kubernetes.io/component: webhook
spec:
  isCA: true
  commonName: {{ $ca }}
  secretName: {{ $ca }}
  duration: {{ printf "%dh" (mul (int .Values.webhook.tls.validityDays) 24) }}
  privateKey:
    algorithm: ECDSA
    size: 256
  issuerRef:
    name: {{ $selfSigned }}
    kind: Issuer
    group: cert-manager.io
---
apiVersion: cert-manager.io/v1
kind: Issuer
metadata:
  name: {{ $ca }}
  namespace: {{ .Release.Namespace }}
  labels:
    {{- include "marucache.labels" . | nindent 4 }}
    app.kubernetes.io/component: webhook
spec:
  ca:
    secretName: {{ $ca }}
---
{{- $issuer = dict "name" $ca "kind" "Issuer" }}
{{- end }}
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ include "marucache.webhook.certName" . }}
  namespace: {{ .Release.Namespace }}
  labels:
    {{- include "marucache.labels" . | nindent 4 }}
    app.kubernetes.io/component: webhook
spec:
  secretName: {{ include "marucache.webhook.secretName" . }}
  commonName: {{ $host }}
  dnsNames:
    - {{ $service }}
    - {{ printf "%s.%s" $service .Release.Namespace }}
    - {{ $host }}
    - {{ printf "%s.cluster.local" $host }}
  duration: {{ $cm.duration }}
  renewBefore: {{ $cm.renewBefore }}
  privateKey:
    algorithm: ECDSA
    size: 256
    rotationPolicy: Always
  usages:
    - server auth
    - digital signature
  issuerRef:
    name: {{ $issuer.name }}
    kind: {{ $issuer.kind | default "Issuer" }}
    group: {{ $issuer.group | default "cert-manager.io" }}
---
{{- end -}}

{{/* The webhook configuration's annotations: the user's, plus cert-manager's CA injection in its mode. */}}
{{- define "marucache.webhook.annotations" -}}
{{- $annotations := deepCopy (.Values.webhook.annotations | default dict) }}
{{- if eq .Values.webhook.tls.mode "certManager" }}
{{- $_ := set $annotations "cert-manager.io/inject-ca-from" (printf "%s/%s" .Release.Namespace (include "marucache.webhook.certName" .)) }}
{{- end }}
{{- with $annotations }}
{{- toYaml . }}
{{- end }}
{{- end -}}
