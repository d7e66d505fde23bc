{{/* Names, labels and the addresses the components give each other. */}}

{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component name>", e.g. demo-kvfleet-controller. Call with (list $ "controller").
     At most 52 characters: a StatefulSet's controller-revision-hash label appends 11 to its name. */}}
{{- define "kvfleet.componentName" -}}
{{- $root := index . 0 }}
{{- $comp := index $root.Values (index . 1) }}
{{- printf "%s-%s" (include "kvfleet.fullname" $root | trunc 40 | trimSuffix "-") $comp.name | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "kvfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every pod of this release carries (Ray pods included); the Redis NetworkPolicy
     admits exactly the pods that have them. */}}
{{- define "kvfleet.peerLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: kvfleet
{{- end }}

{{/* Ray pods: KubeRay sets app.kubernetes.io/name (kuberay) and created-by itself and may select
     on them, so these leave both alone. Call with (list $ "workers"). */}}
{{- define "kvfleet.rayPodLabels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "kvfleet.chart" $root }}
{{ include "kvfleet.peerLabels" $root }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ include "kvfleet.chart" . }}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- end }}

{{/* Component labels; call with (list $ "controller"). */}}
{{- define "kvfleet.componentSelectorLabels" -}}
{{ include "kvfleet.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "kvfleet.componentLabels" -}}
{{ include "kvfleet.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "kvfleet.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvfleet.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "kvfleet.fullname" . | trunc 40 | trimSuffix "-")) }}
{{- end }}

{{/* The chart's own Redis (no password). Yours (redis.external) is read from a Secret: _redis.tpl. */}}
{{- define "kvfleet.redisUrl" -}}
{{- printf "redis://%s:6379/%d" (include "kvfleet.componentName" (list . "redis")) (int .Values.redis.database) }}
{{- end }}

{{- define "kvfleet.controllerAddress" -}}
{{- printf "%s:%d" (include "kvfleet.componentName" (list . "controller")) (int .Values.controller.grpcPort) }}
{{- end }}

{{/* The KubeRay head Service is "<raycluster name>-head-svc"; its Ray client port is 10001. */}}
{{- define "kvfleet.rayAddress" -}}
{{- printf "ray://%s-head-svc:10001" (include "kvfleet.componentName" (list . "workers")) }}
{{- end }}

{{/* Container security context for kvfleet's own containers. */}}
{{- define "kvfleet.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* Refuse value combinations a JSON schema cannot say clearly (also enforced in values.schema.json
     where it can, so `helm lint` catches them too). */}}
{{- define "kvfleet.validate" -}}
{{- if and (gt (int .Values.controller.replicas) 1) (not .Values.controller.leaderElection.enabled) }}
{{- fail (printf "controller.replicas=%d needs controller.leaderElection.enabled=true: two active controllers would both run the vLLM watchers and bump route epochs" (int .Values.controller.replicas)) }}
{{- end }}
{{- /* NOTE: this is the only check of a URL with redis.create=true: the schema's was "maxLength: got 16, want 0". */}}
{{- $ext := .Values.redis.external }}
{{- if and .Values.redis.create $ext.url }}
{{- fail "redis.external.url is set but redis.create=true: set redis.create=false to use your own Redis, or clear redis.external.url" }}
{{- end }}
{{- if and .Values.redis.create $ext.existingSecret }}
{{- fail "redis.external.existingSecret is set but redis.create=true: set redis.create=false to use your own Redis, or clear redis.external.existingSecret" }}
{{- end }}
{{- if and (not .Values.redis.create) (not $ext.url) (not $ext.existingSecret) }}
{{- fail "redis.create=false needs redis.external.url (redis://HOST:PORT/DB) or redis.external.existingSecret (a Secret holding that URL)" }}
{{- end }}
{{- if and $ext.url $ext.existingSecret }}
{{- fail "redis.external.url and redis.external.existingSecret are both set: give one (the Secret, if the URL holds a password)" }}
{{- end }}
{{- if and .Values.tls.clientCa (not .Values.tls.enabled) }}
{{- fail "tls.clientCa=true (mutual TLS) needs tls.enabled=true and tls.secretName" }}
{{- end }}
{{- if and .Values.tls.clientCa (not .Values.tls.clientSecretName) }}
{{- fail "tls.clientCa=true needs tls.clientSecretName: a kubernetes.io/tls Secret with the client certificate the proxy and the watcher job present" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled=true needs tls.secretName (a kubernetes.io/tls Secret with tls.crt and tls.key)" }}
{{- end }}
{{- if and .Values.auth.existingSecret (or .Values.auth.tokens) }}
{{- fail "auth.tokens is ignored with auth.existingSecret: put those tokens in your Secret's tokens.json" }}
{{- end }}
{{- if and (not .Values.auth.existingSecret) (not .Values.auth.bootstrapOperator) (not .Values.auth.tokens) }}
{{- fail "no tokens: set auth.bootstrapOperator=true, add auth.tokens, or give auth.existingSecret" }}
{{- end }}
{{- range .Values.workers.groups }}
{{- if and (gt (int .gpus) 0) (ne $.Values.image.variant "cuda") (not $.Values.image.tag) }}
{{- fail (printf "workers.groups[%s] asks for %d GPU(s) but image.variant=%s: set image.variant=cuda" .name (int .gpus) $.Values.image.variant) }}
{{- end }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "workers.groups[%s]: minReplicas=%d > maxReplicas=%d" .name (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- $kdev := toString (default "cpu" (dig "device" "cpu" (default dict .kernel))) }}
{{- $default := toString (default "cpu" (dig "device" "cpu" (default dict $.Values.workers.kernel))) }}
{{- if and (not .kernel) (hasPrefix "cuda" $default) (eq (int .gpus) 0) }}
{{- fail (printf "workers.groups[%s] has no GPU (gpus: 0) but runs the default kernel, workers.kernel.device=%s: a node without a GPU never runs a CUDA kernel, so it would get no sessions; give the group kernel: {backend: numpy, device: cpu}, or gpus > 0" .name $default) }}
{{- end }}
{{- if and (hasPrefix "cuda" $kdev) (eq (int .gpus) 0) }}
{{- fail (printf "workers.groups[%s].kernel.device=%s needs gpus > 0 on that group: a node without a GPU never runs a CUDA kernel (it would get no sessions)" .name $kdev) }}
{{- end }}
{{- if and (hasPrefix "cuda" $kdev) (eq (toString (dig "backend" "numpy" (default dict .kernel))) "numpy") }}
{{- fail (printf "workers.groups[%s].kernel: the numpy backend runs on cpu only; use backend: torch for %s" .name $kdev) }}
{{- end }}
{{- end }}
{{- if .Values.proxy.create }}
{{- include "kvfleet.validateProxyBodies" . }}
{{- if eq (int .Values.proxy.port) (int .Values.proxy.metricsPort) }}
{{- fail (printf "proxy.metricsPort=%d is proxy.port: give the proxy's /metrics a port of its own (its series name every worker; the HTTP port is the tenants')" (int .Values.proxy.metricsPort)) }}
{{- end }}
{{- end }}
{{- if and .Values.watcher.create (not .Values.controller.create) }}
{{- fail "watcher.create=true needs controller.create=true (the Job registers workers with this release's controller)" }}
{{- end }}
{{- /* Without tokenSecret.name the proxy and the Job read `operator-token` from the auth Secret:
       the chart's (bootstrapOperator=true) or yours (existingSecret). */}}
{{- $hasOperatorToken := or .Values.auth.bootstrapOperator .Values.auth.existingSecret }}
{{- range $comp := list "proxy" "watcher" }}
{{- $v := index $.Values $comp }}
{{- $readsOperator := or (eq $comp "watcher") (eq (include "kvfleet.proxyTokenKey" $) "operator-token") }}
{{- if and $v.create (not $v.tokenSecret.name) (not $hasOperatorToken) $readsOperator }}
{{- fail (printf "%s.create=true needs an operator token: set %s.tokenSecret.name, or keep auth.bootstrapOperator=true" $comp $comp) }}
{{- end }}
{{- end }}
{{- end }}

{{- /* The proxy refuses to start unless --max-body-bytes fits one tenant's share of the bodies in flight
       (controller/proxy/config.py): at most --max-inflight-bytes-per-tenant and half of --max-inflight-bytes.
       The chart has no value for --max-body-bytes: it is the proxy's 8 MiB unless proxy.extraArgs sets it. */}}
{{- define "kvfleet.validateProxyBodies" -}}
{{- $p := .Values.proxy }}
{{- $body := int64 8388608 }}
{{- $from := "the proxy's default, 8 MiB" }}
{{- range $i, $a := $p.extraArgs }}
{{- $a = toString $a }}
{{- if and (eq $a "--max-body-bytes") (lt (add1 $i) (len $p.extraArgs)) }}
{{- $body = int64 (index $p.extraArgs (add1 $i)) }}
{{- $from = "set in proxy.extraArgs" }}
{{- else if hasPrefix "--max-body-bytes=" $a }}
{{- $body = int64 (trimPrefix "--max-body-bytes=" $a) }}
{{- $from = "set in proxy.extraArgs" }}
{{- end }}
{{- end }}
{{- $perTenant := int64 $p.maxInflightBytesPerTenant }}
{{- $total := int64 $p.maxInflightBytes }}
{{- if lt $perTenant $body }}
{{- fail (printf "proxy.maxInflightBytesPerTenant=%d is below the proxy's --max-body-bytes (%d, %s): the proxy would refuse to start; set proxy.maxInflightBytesPerTenant to at least %d" $perTenant $body $from $body) }}
{{- end }}
{{- if lt (div $total 2) $body }}
{{- fail (printf "proxy.maxInflightBytes=%d is below twice the proxy's --max-body-bytes (%d, %s): the proxy would refuse to start; set proxy.maxInflightBytes to at least %d" $total $body $from (mul $body 2)) }}
{{- end }}
{{- end }}

{{- /* The proxy pods' grace period: proxy.terminationGracePeriodSeconds, or the shutdown delay + drain + 10 s
       (the cut of what is left, at most 2 s, and the proxy's closing). A value under delay + drain is refused:
       the kubelet's SIGKILL would cut the drain short. */}}
{{- define "kvfleet.proxyGraceSeconds" -}}
{{- $p := .Values.proxy }}
{{- $need := int64 (ceil (addf $p.shutdownDelaySeconds $p.shutdownDrainSeconds)) }}
{{- if kindIs "invalid" $p.terminationGracePeriodSeconds }}
{{- add $need 10 }}
{{- else if lt (int64 $p.terminationGracePeriodSeconds) $need }}
{{- fail (printf "proxy.terminationGracePeriodSeconds=%v is under proxy.shutdownDelaySeconds + proxy.shutdownDrainSeconds (%d): the kubelet would kill the proxy mid-drain; raise it or lower the drain" $p.terminationGracePeriodSeconds $need) }}
{{- else }}
{{- int64 $p.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{- /* The proxy's own token (it only lists the workers): without proxy.tokenSecret.name/key, a reader
       token the chart mints into its auth Secret (`proxy-token`); with existingSecret, that Secret's
       `operator-token` (as before); with a name but no key, `operator-token` of that Secret. */}}
{{- define "kvfleet.proxyMintsToken" -}}
{{- $t := .Values.proxy.tokenSecret -}}
{{- and .Values.proxy.create (not .Values.auth.existingSecret) (not $t.name) (not $t.key) -}}
{{- end }}

{{- define "kvfleet.proxyTokenKey" -}}
{{- $t := .Values.proxy.tokenSecret -}}
{{- if $t.key }}{{ $t.key }}{{ else if eq (include "kvfleet.proxyMintsToken" .) "true" }}proxy-token{{ else }}operator-token{{ end -}}
{{- end }}
