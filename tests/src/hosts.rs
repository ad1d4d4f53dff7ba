//! Several machines on one, for tests that cross hosts.
//!
//! A [`Host`] is a network, mount, UTS and IPC namespace held by a sleeping process: its own
//! address on one bridge (`10.251.N.0/24`, `eth0`), hostname, boot id and `/dev/shm`, so UCX
//! takes it for another machine and moves KV over TCP as between real machines, and an
//! `/etc/hosts` naming every host of its [`Net`] (plus aliases: the DNS names a deployment
//! uses). A process runs on a host through `nsenter` ([`Host::command`]), or as PID 1 of a PID
//! namespace of its own ([`Host::container`]), as container runtimes start it. The test process
//! reaches every host over one more veth on the bridge (`10.251.N.254`); nothing else is routed.
//!
//! Made with `unshare`, `nsenter` (util-linux) and `ip` (iproute2); needs root, which CI has.
//! Where namespaces cannot be made, [`Net::new`] panics saying why: a cross-host test fails, it
//! never skips. Dropping the net kills the holders; the namespaces, veths and mounts go with
//! them (drop the processes started on its hosts first).

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

/// How long a namespace holder may take to come up.
const HOLDER_TIMEOUT: Duration = Duration::from_secs(20);

/// Hosts on one bridge.
#[derive(Debug)]
pub struct Net {
    subnet: u8,
    bridge: Holder,
    /// The veth end in the test's own namespace.
    root_if: String,
    dir: PathBuf,
    /// `/etc/hosts` of every host (rewritten in place as hosts and aliases are added).
    names: Mutex<Vec<(Ipv4Addr, String)>>,
    next: Mutex<u8>,
}

/// One machine of a [`Net`].
#[derive(Debug)]
pub struct Host {
    /// Its hostname.
    pub name: String,
    /// Its address on the bridge.
    pub addr: Ipv4Addr,
    holder: Holder,
    boot_id: PathBuf,
}

/// A running packet capture ([`Net::capture`]).
#[derive(Debug)]
pub struct Capture(Holder);

impl Capture {
    /// Stops the capture (SIGINT: tcpdump flushes its file) and waits for it; frames sent up to
    /// half a second before are in the file.
    pub fn stop(mut self) {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let child = &mut (self.0).0;
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGINT);
        }
        let _ = child.wait();
    }
}

/// A process holding namespaces, killed on drop.
#[derive(Debug)]
struct Holder(Child);

impl Holder {
    /// Runs `unshare <flags> -- sh -c <script>` and waits for the script to print `ready`.
    fn start(what: &str, flags: &[&str], script: &str) -> Self {
        let mut cmd = Command::new("unshare");
        cmd.args(flags)
            .args(["--", "sh", "-c"])
            .arg(format!("{script}\necho ready\nexec sleep 2147483647"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: prctl only sets this child's parent-death signal, between fork and exec. The
        // holder dies with the thread that made it even if the test process is killed.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| {
            panic!("cannot start `unshare` for {what} ({e}): cross-host tests need util-linux")
        });
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        match rx.recv_timeout(HOLDER_TIMEOUT) {
            Ok(line) if line.trim() == "ready" => Self(child),
            _ => {
                let _ = child.kill();
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                let _ = child.wait();
                panic!(
                    "cannot make the namespaces of {what} (`unshare {}`): {}\ncross-host tests \
                     need root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and a kernel with network, mount, \
                     UTS and PID namespaces",
                    flags.join(" "),
                    err.trim()
                )
            }
        }
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `program args` to completion; panics with its output when it fails.
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"));
    assert!(
        out.status.success(),
        "`{program} {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// `nsenter --target pid --net -- args...` to completion.
fn in_net(pid: u32, args: &[&str]) {
    let target = format!("--target={pid}");
    let mut all = vec![target.as_str(), "--net", "--"];
    all.extend_from_slice(args);
    run("nsenter", &all);
}

impl Net {
    /// A bridge in a namespace of its own, reachable from the test process. `dir` holds the
    /// hosts' boot ids and `/etc/hosts`.
    pub fn new(dir: &Path) -> Self {
        let bridge = Holder::start(
            "the bridge",
            &["--net"],
            "ip link set lo up && ip link add br0 type bridge && ip link set br0 up",
        );
        // A subnet whose veth name is free in our namespace: `ip link add` is the lock.
        let start = (std::process::id() % 200) as u8;
        let mut found = None;
        for i in 0..=250u8 {
            let subnet = (start.wrapping_add(i) % 250) + 1;
            let root_if = format!("pdnet{subnet}");
            let pid = bridge.pid().to_string();
            let ok = Command::new("ip")
                .args([
                    "link", "add", &root_if, "type", "veth", "peer", "name", "uplink",
                ])
                .args(["netns", &pid])
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                found = Some((subnet, root_if));
                break;
            }
        }
        let (subnet, root_if) =
            found.expect("no free pdnetN interface name: cannot link the test to its hosts");
        let root_addr = format!("10.251.{subnet}.254/24");
        run("ip", &["addr", "add", &root_addr, "dev", &root_if]);
        run("ip", &["link", "set", &root_if, "up"]);
        in_net(
            bridge.pid(),
            &["ip", "link", "set", "uplink", "master", "br0", "up"],
        );
        let dir = dir.join("hosts");
        std::fs::create_dir_all(&dir).expect("creating the hosts directory");
        let net = Self {
            subnet,
            bridge,
            root_if,
            dir,
            names: Mutex::new(Vec::new()),
            next: Mutex::new(1),
        };
        net.write_hosts_file();
        net
    }

    /// Starts `tcpdump` on the bridge, writing every frame on it (between the hosts, and
    /// between them and the test process) to `file`; returns once it captures. Stop it with
    /// [`Capture::stop`] before reading the file.
    pub fn capture(&self, file: &Path) -> Capture {
        let target = format!("--target={}", self.bridge.pid());
        let mut child = Command::new("nsenter")
            .args([
                target.as_str(),
                "--net",
                "--",
                "tcpdump",
                "-i",
                "br0",
                "--immediate-mode",
                "-U",
            ])
            .arg("-w")
            .arg(file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start tcpdump ({e}): scripts/setup.sh installs it"));
        let mut err = BufReader::new(child.stderr.take().expect("piped"));
        let mut line = String::new();
        let _ = err.read_line(&mut line);
        assert!(
            line.contains("listening on"),
            "tcpdump did not start: {line}"
        );
        Capture(Holder(child))
    }

    /// The test process's own address on the bridge.
    pub fn gateway_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 251, self.subnet, 254)
    }

    fn hosts_file(&self) -> PathBuf {
        self.dir.join("etc-hosts")
    }

    /// Rewrites `/etc/hosts` of every host in place (the hosts bind-mount this inode).
    fn write_hosts_file(&self) {
        let mut text = String::from("127.0.0.1\tlocalhost\n::1\tlocalhost\n");
        for (ip, name) in self.names.lock().expect("names").iter() {
            text.push_str(&format!("{ip}\t{name}\n"));
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(self.hosts_file())
            .expect("opening the hosts file");
        std::io::Write::write_all(&mut f, text.as_bytes()).expect("writing the hosts file");
    }

    /// Makes `name` resolve to `host` on every host (a DNS name of the deployment).
    pub fn alias(&self, name: &str, host: &Host) {
        self.names
            .lock()
            .expect("names")
            .push((host.addr, name.to_owned()));
        self.write_hosts_file();
    }

    /// A new host named `name` (a hostname: letters, digits, `-`).
    pub fn host(&self, name: &str) -> Host {
        let index = {
            let mut next = self.next.lock().expect("next");
            let i = *next;
            assert!(i < 250, "at most 249 hosts on one net");
            *next += 1;
            i
        };
        let addr = Ipv4Addr::new(10, 251, self.subnet, index);
        let boot_id = self.dir.join(format!("boot_id.{name}"));
        std::fs::write(&boot_id, format!("{}\n", uuid_like(index, self.subnet)))
            .expect("writing a boot id");
        let script = format!(
            "set -e\nhostname {name}\nmount -t tmpfs -o size=1g,mode=1777 shm-{name} /dev/shm\n\
             mount --bind {boot} /proc/sys/kernel/random/boot_id\n\
             mount --bind {hosts} /etc/hosts\nip link set lo up",
            boot = boot_id.display(),
            hosts = self.hosts_file().display()
        );
        let holder = Holder::start(
            &format!("host {name}"),
            &[
                "--net",
                "--mount",
                "--uts",
                "--ipc",
                "--propagation",
                "private",
            ],
            &script,
        );
        let (pid, bridge) = (holder.pid().to_string(), self.bridge.pid().to_string());
        let peer = format!("h{index}");
        run(
            "ip",
            &[
                "link", "add", "eth0", "netns", &pid, "type", "veth", "peer", "name", &peer,
                "netns", &bridge,
            ],
        );
        in_net(
            self.bridge.pid(),
            &["ip", "link", "set", &peer, "master", "br0", "up"],
        );
        let cidr = format!("{addr}/24");
        in_net(holder.pid(), &["ip", "addr", "add", &cidr, "dev", "eth0"]);
        in_net(holder.pid(), &["ip", "link", "set", "eth0", "up"]);
        self.names
            .lock()
            .expect("names")
            .push((addr, name.to_owned()));
        self.write_hosts_file();
        Host {
            name: name.to_owned(),
            addr,
            holder,
            boot_id,
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Killing the bridge's holder removes its veths, and with them ours; say so if not.
        let _ = Command::new("ip")
            .args(["link", "del", &self.root_if])
            .stderr(Stdio::null())
            .status();
    }
}

/// A boot id unique to the host (UUID-shaped, as the kernel's).
fn uuid_like(index: u8, subnet: u8) -> String {
    let r = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        (r >> 32) as u32,
        r as u16,
        index,
        subnet,
        std::process::id()
    )
}

impl Host {
    fn nsenter(&self) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--target={}", self.holder.pid()))
            .args(["--net", "--mount", "--uts", "--ipc", "--"]);
        cmd
    }

    /// `program` run on this host (in its namespaces; the pid is the program's own).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = self.nsenter();
        cmd.arg(program);
        cmd
    }

    /// `program` run on this host as PID 1 of a PID namespace of its own, as a container
    /// runtime starts it (its own `/proc`; the host's boot id bound over it again). The pid is
    /// `unshare`'s: signal the program through [`crate::process::Proc::spawn_contained`].
    pub fn container(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = self.nsenter();
        cmd.args([
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!(
            "mount --bind {} /proc/sys/kernel/random/boot_id && exec \"$@\"",
            self.boot_id.display()
        ))
        .arg("container")
        .arg(program);
        cmd
    }

    /// `http(s)://ADDR:PORT` for `listened`, a `http(s)://HOST:PORT` or `HOST:PORT` a process on
    /// this host printed (a wildcard host becomes this host's address).
    pub fn url(&self, listened: &str) -> String {
        let (scheme, rest) = listened.split_once("://").unwrap_or(("http", listened));
        let port = rest
            .rsplit(':')
            .next()
            .unwrap_or(rest)
            .trim_end_matches('/');
        format!("{scheme}://{}:{port}", self.addr)
    }
}

/// Where a process runs: on the test's own machine, or on a host, as a container or not.
#[derive(Debug, Clone, Copy)]
pub enum Place<'a> {
    /// Here, on loopback.
    Local,
    /// On `host`, bound to its address.
    On(&'a Host),
    /// On `host` as a container: PID 1, bound to `0.0.0.0`.
    Container(&'a Host),
}

impl Place<'_> {
    /// The command running `program` here or there; whether it is contained.
    pub fn command(self, program: &Path) -> (Command, bool) {
        match self {
            Place::Local => (Command::new(program), false),
            Place::On(h) => (h.command(program), false),
            Place::Container(h) => (h.container(program), true),
        }
    }

    /// `--host` for a process placed here (none: its default, loopback).
    pub fn bind(self) -> Option<String> {
        match self {
            Place::Local => None,
            Place::On(h) => Some(h.addr.to_string()),
            Place::Container(_) => Some("0.0.0.0".into()),
        }
    }

    /// The URL the test process reaches `printed` (what the process printed) at.
    pub fn url(self, printed: &str) -> String {
        match self {
            Place::Local => printed.to_owned(),
            Place::On(h) | Place::Container(h) => h.url(printed),
        }
    }
}
