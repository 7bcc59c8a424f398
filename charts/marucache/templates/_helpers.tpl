{{/*
Helpers of the marucache chart. Every name is prefixed with "marucache." (template
names are global across subcharts) and every object name is truncated to 63
characters (the DNS label limit), leaving room for the component suffix.
*/}}

{{/* The chart's name, or nameOverride. */}}
{{- define "marucache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release's base name: fullnameOverride, else RELEASE-marucache (just RELEASE
when the release name already contains the chart name). At most 45 characters,
so that component suffixes ("-operator", "-dashboard-overview") fit in 63; names
with longer suffixes are truncated to 63 once more.
*/}}
{{- define "marucache.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of the operator's Deployment, Service and ClusterRole(Binding). */}}
{{- define "marucache.operator.fullname" -}}
{{- printf "%s-operator" (include "marucache.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of the Secret that holds the webhook's serving certificate. */}}
{{- define "marucache.webhook.secretName" -}}
{{- if .Values.webhook.tls.secretName -}}
{{- .Values.webhook.tls.secretName -}}
{{- else -}}
{{- printf "%s-webhook-tls" (include "marucache.operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The Service's DNS name the API server calls the webhook at (also the certificate's name). */}}
{{- define "marucache.webhook.host" -}}
{{- printf "%s.%s.svc" (include "marucache.operator.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* The ServiceAccount the operator runs as, resolved in one place. */}}
{{- define "marucache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "marucache.operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* helm.sh/chart label value: name-version, "+" replaced (not allowed in labels). */}}
{{- define "marucache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object of the release. */}}
{{- define "marucache.labels" -}}
helm.sh/chart: {{ include "marucache.chart" . }}
{{ include "marucache.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels that select the operator's pods (never change them on upgrade). */}}
{{- define "marucache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "marucache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
The operator's image reference. Takes the image dict (repository, tag, digest)
and the root context, as a list of two: (list .Values.operator.image .). A digest
wins over a tag; an empty tag means the chart's appVersion.
*/}}
{{- define "marucache.image" -}}
{{- if ne (len .) 2 -}}
{{- fail "marucache.image expects (list IMAGE_VALUES ROOT_CONTEXT)" -}}
{{- end -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* ServiceMonitor and PodMonitor scrape the same targets: one of them at most. */}}
{{- define "marucache.monitoring.check" -}}
{{- if and .Values.monitoring.serviceMonitor.enabled .Values.monitoring.podMonitor.enabled -}}
{{- fail "monitoring.serviceMonitor.enabled and monitoring.podMonitor.enabled are both true: they scrape the same targets; enable only one" -}}
{{- end -}}
{{- end -}}

{{/* The webhook's TLS settings must be complete for the chosen mode. */}}
{{- define "marucache.webhook.check" -}}
{{- if and .Values.webhook.enabled (eq .Values.webhook.tls.mode "secret") (not .Values.webhook.tls.secretName) -}}
{{- fail "webhook.tls.mode is \"secret\": set webhook.tls.secretName to a kubernetes.io/tls Secret in the release namespace" -}}
{{- end -}}
{{- if and .Values.webhook.enabled (eq .Values.webhook.tls.mode "secret") (not .Values.webhook.tls.caBundle) (not .Values.webhook.annotations) -}}
{{- fail "webhook.tls.mode is \"secret\": set webhook.tls.caBundle (base64 PEM of the CA) or webhook.annotations for a CA injector (e.g. cert-manager.io/inject-ca-from)" -}}
{{- end -}}
{{- end -}}


{{/* The leader election Lease's name. */}}
{{- define "marucache.leaseName" -}}
{{- default (include "marucache.operator.fullname" .) .Values.operator.leaderElection.leaseName -}}
{{- end -}}

{{/*
The operator's rules on namespaced resources: in its ClusterRole (cluster-wide), or in a Role
per namespace of operator.watchNamespaces.
*/}}
{{- define "marucache.operator.namespacedRules" -}}
# MaruCaches: watched, their finalizer and kopf's progress annotations patched.
- apiGroups: [maru.io]
  resources: [marucaches]
  verbs: [get, list, watch, patch]
# Conditions, allocations and the index endpoint are written to the status subresource.
- apiGroups: [maru.io]
  resources: [marucaches/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion: the API server requires
# update on the owner's finalizers for that (OwnerReferencesPermissionEnforcement).
- apiGroups: [maru.io]
  resources: [marucaches/finalizers]
  verbs: [update]
# Children of each cache: the connector ConfigMap (and, cluster-wide, the region ledger in the
# release namespace), the index Service, Deployment and NetworkPolicy; created, read, patched.
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [get, create, patch]
# The index token Secret is created once and never read back or changed.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# Index Deployments are also watched (their availability makes a cache Ready).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
# Pods labelled maru.io/cache: watched (read only) to find those that run without the sidecar or
# with an old pool placement (Event, gauge, PodsCurrent condition).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# Every action and refusal is reported as an Event on the MaruCache, on a pod the webhook could
# not inject, and on a stale pod.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* Name of the operator's Role in each namespace of operator.watchNamespaces. */}}
{{- define "marucache.operator.scopedRoleName" -}}
{{- printf "%s-caches" (include "marucache.operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of the operator's Role on the ledger ConfigMap (with operator.watchNamespaces). */}}
{{- define "marucache.operator.ledgerRoleName" -}}
{{- printf "%s-ledger" (include "marucache.operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* namespaceSelector of the monitors of indexes and sidecars: the watched namespaces, else any. */}}
{{- define "marucache.monitor.namespaceSelector" -}}
{{- with .Values.operator.watchNamespaces -}}
matchNames:
  {{- toYaml . | nindent 2 }}
{{- else -}}
any: true
{{- end -}}
{{- end -}}

{{/*
The webhook's namespaceSelector: webhook.namespaceSelector, and with operator.watchNamespaces
also those namespaces only (pods elsewhere are never sent to the webhook). Empty: every namespace.
*/}}
{{- define "marucache.webhook.namespaceSelector" -}}
{{- $selector := deepCopy (.Values.webhook.namespaceSelector | default dict) -}}
{{- with .Values.operator.watchNamespaces -}}
{{- $watched := dict "key" "kubernetes.io/metadata.name" "operator" "In" "values" . -}}
{{- $_ := set $selector "matchExpressions" (append ($selector.matchExpressions | default list) $watched) -}}
{{- end -}}
{{- with $selector -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}
