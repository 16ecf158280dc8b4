# Sourced by .ci/run (as root, on a fresh Debian 12 machine): installs the Docker
# engine, the Compose v2 plugin and debootstrap, starts dockerd in the background
# and waits until it answers. Safe to source twice: every part checks first.
#
# Debian 12 ships only Compose v1 (docker-compose, Python). Debian 13's
# `docker-compose` package carries the v2 plugin binary, which is static and runs
# on Debian 12: it is downloaded through a private trixie source list (the
# system's apt configuration is left untouched) and unpacked with dpkg -x.

_eyrie_docker_setup() {
    local plugin_dir=/usr/local/lib/docker/cli-plugins
    export DEBIAN_FRONTEND=noninteractive

    if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
        apt-get install -y -qq --no-install-recommends \
            docker.io debootstrap ca-certificates iptables >/dev/null
    fi

    if ! docker compose version >/dev/null 2>&1; then
        local tmp
        tmp="$(mktemp -d)"
        mkdir -p "$tmp/lists/partial" "$tmp/archives/partial" "$tmp/unpacked"
        cat >"$tmp/trixie.sources" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
        local apt_opts=(
            -o "Dir::Etc::SourceList=/dev/null"
            -o "Dir::Etc::SourceParts=$tmp/parts"
            -o "Dir::State::Lists=$tmp/lists"
            -o "Dir::Cache::Archives=$tmp/archives"
            -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
            -o "APT::Sandbox::User=root"
        )
        mkdir -p "$tmp/parts" && mv "$tmp/trixie.sources" "$tmp/parts/"
        apt-get "${apt_opts[@]}" update -qq
        (cd "$tmp" && apt-get "${apt_opts[@]}" download -qq docker-compose)
        dpkg -x "$tmp"/docker-compose_*.deb "$tmp/unpacked"
        mkdir -p "$plugin_dir"
        install -m 0755 "$(find "$tmp/unpacked" -type f -name docker-compose -path '*cli-plugins*' | head -n1)" \
            "$plugin_dir/docker-compose"
        rm -rf "$tmp"
    fi

    if ! docker info >/dev/null 2>&1; then
        # overlay2 on the host's ext4; cgroup v1 or v2, whichever the host has.
        nohup dockerd --storage-driver=overlay2 >/var/log/eyrie-dockerd.log 2>&1 &
        local waited=0
        until docker info >/dev/null 2>&1; do
            if [ "$waited" -ge 60 ]; then
                echo "dockerd did not answer within 60 s; see /var/log/eyrie-dockerd.log:" >&2
                tail -n 20 /var/log/eyrie-dockerd.log >&2
                return 1
            fi
            sleep 1
            waited=$((waited + 1))
        done
    fi
    docker compose version
}

_eyrie_docker_setup
# From here on a missing engine fails the docker-marked tests instead of skipping them.
export EYRIE_REQUIRE_DOCKER=1
