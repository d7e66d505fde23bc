{{/* The chart's Redis: how much memory it may hold before it refuses writes. */}}

{{/* Bytes of a Kubernetes memory quantity (4Gi, 600M, 1073741824, 1.5Gi), as an int64 string.
     Memory has no millis: "m" and exponent forms are refused with a message. */}}
{{- define "kvfleet.quantityBytes" -}}
{{- $q := . -}}
{{- if not (kindIs "string" $q) }}
{{- int64 $q -}}
{{- else }}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 }}
{{- $mult := 1.0 }}
{{- $num := $q }}
{{- range $suffix, $m := $units }}
{{- if hasSuffix $suffix $q }}
{{- $mult = float64 $m }}
{{- $num = trimSuffix $suffix $q }}
{{- end }}
{{- end }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?$" $num) }}
{{- fail (printf "memory quantity %q: use bytes or a number with Ki, Mi, Gi, Ti, k, M, G or T" $q) }}
{{- end }}
{{- int64 (floor (mulf (float64 $num) $mult)) -}}
{{- end }}
{{- end }}

{{/* Redis's --maxmemory in bytes: redis.maxmemory, or half of redis.resources.limits.memory.
     NOTE: half, because an AOF rewrite (automatic once the AOF doubles) forks Redis and every page the
     parent writes while the child runs is copied, charged to the same cgroup: up to the data set twice. */}}
{{- define "kvfleet.redisMaxmemory" -}}
{{- $r := .Values.redis }}
{{- $limit := dig "limits" "memory" "" (default dict $r.resources) }}
{{- if and (kindIs "invalid" $r.maxmemory) (not $limit) }}
{{- fail "redis.resources.limits.memory is not set: set it, or redis.maxmemory (without either Redis grows until the node runs out of memory)" }}
{{- end }}
{{- $max := 0 }}
{{- if kindIs "invalid" $r.maxmemory }}
{{- $max = div (int64 (include "kvfleet.quantityBytes" $limit)) 2 }}
{{- else }}
{{- $max = int64 (include "kvfleet.quantityBytes" $r.maxmemory) }}
{{- end }}
{{- if and $limit (ge (int64 $max) (int64 (include "kvfleet.quantityBytes" $limit))) }}
{{- fail (printf "redis.maxmemory=%v is not under redis.resources.limits.memory=%v: the kernel would kill Redis before it refused a write; keep it at about half the limit (an AOF rewrite forks Redis)" $r.maxmemory $limit) }}
{{- end }}
{{- if lt (int64 $max) 1048576 }}
{{- fail (printf "redis.maxmemory is %d bytes: below 1Mi Redis refuses almost every write" (int64 $max)) }}
{{- end }}
{{- int64 $max -}}
{{- end }}

{{/* Your own Redis (redis.create=false): the controller reads its URL, which may hold a password, as
     KVFLEET_STORE from a Secret (yours, redis.external.existingSecret, or the chart's, made from
     redis.external.url), never from its arguments. */}}
{{- define "kvfleet.redisUrlSecretName" -}}
{{- .Values.redis.external.existingSecret | default (printf "%s-url" (include "kvfleet.componentName" (list . "redis"))) }}
{{- end }}

{{- define "kvfleet.redisUrlSecretKey" -}}
{{- if .Values.redis.external.existingSecret }}{{ .Values.redis.external.existingSecretKey }}{{ else }}url{{ end }}
{{- end }}

{{/* The store as NOTES.txt shows it: no user, password or query parameter (redis-py reads a password from
     either), whatever the URL's form. Everything up to the last "@" is the user info. */}}
{{- define "kvfleet.storeShown" -}}
{{- $ext := .Values.redis.external }}
{{- if .Values.redis.create }}
{{- include "kvfleet.redisUrl" . }}
{{- else if $ext.existingSecret }}
{{- printf "your Redis, its URL in Secret %s (key %s)" $ext.existingSecret (include "kvfleet.redisUrlSecretKey" .) }}
{{- else }}
{{- $base := regexReplaceAll "[?#].*$" $ext.url "" }}
{{- $scheme := regexFind "^[A-Za-z][A-Za-z0-9+.-]*://" $base }}
{{- $rest := trimPrefix $scheme $base }}
{{- if contains "@" $rest }}
{{- $rest = printf "***@%s" (regexReplaceAll "^.*@" $rest "") }}
{{- end }}
{{- printf "%s%s%s (your Redis; the URL is in Secret %s)" $scheme $rest (ternary "?…" "" (ne $base $ext.url)) (include "kvfleet.redisUrlSecretName" .) }}
{{- end }}
{{- end }}
