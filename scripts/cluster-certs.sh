#!/usr/bin/env bash
# Mints a cluster CA and certificates for mutual TLS (pd-gateway / pd-node `--tls-cert`,
# `--tls-key`, `--tls-ca`), with openssl.
#
#   bash scripts/cluster-certs.sh DIR NAME=SAN[,SAN...] [NAME=SAN...]
#   bash scripts/cluster-certs.sh certs gateway=IP:10.0.0.1,DNS:gw.example node-a=IP:10.0.0.2
#
# Writes DIR/ca.pem and DIR/ca.key once (kept on later runs: new members join the same CA),
# and DIR/NAME.pem, DIR/NAME.key for each NAME: an EC P-256 key and a certificate valid for
# serving and for client authentication, naming each SAN (IP:... or DNS:...; a bare address
# or name is taken as IP or DNS). Every address a peer dials a process at must be a SAN of its
# certificate. Keep ca.key off the cluster's machines; each process needs only its own pair
# and ca.pem.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
command -v openssl >/dev/null || { echo "cluster-certs: openssl is needed (apt-get install openssl)" >&2; exit 1; }
dir=$1; shift
mkdir -p "$dir"
umask 077
if [ ! -s "$dir/ca.pem" ] || [ ! -s "$dir/ca.key" ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$dir/ca.key" -out "$dir/ca.pem" -days 3650 -subj "/CN=pd-serve cluster CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi
for spec in "$@"; do
    name=${spec%%=*}
    sans=${spec#*=}
    [ -n "$name" ] && [ "$name" != "$spec" ] || { echo "cluster-certs: '$spec' is not NAME=SAN[,SAN...]" >&2; exit 2; }
    list=""
    IFS=, read -ra items <<<"$sans"
    for s in "${items[@]}"; do
        case $s in
            IP:*|DNS:*) ;;
            *[!0-9.:]*) s="DNS:$s" ;;
            *) s="IP:$s" ;;
        esac
        list="${list:+$list,}$s"
    done
    ext=$(mktemp)
    printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n' "$list" >"$ext"
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$dir/$name.key" -subj "/CN=$name" 2>/dev/null |
        openssl x509 -req -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
            -days 825 -extfile "$ext" -out "$dir/$name.pem" 2>/dev/null
    rm -f "$ext"
done
