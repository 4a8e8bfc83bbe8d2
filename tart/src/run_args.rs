//! Typed `tart run` flags beyond `--no-graphics`: directory shares (`--dir`) and the VM's network
//! (`--net-softnet`, `--net-softnet-allow`), rendered into [`crate::RunOptions::extra_args`].
//!
//! tart parses `--dir [name:]path[:options]` by splitting at `:` and reading the last part as
//! comma-separated options when one of them is `ro` or `tag=…` (`DirectoryShare(parseFrom:)` in
//! `Sources/tart/Commands/Run.swift`). So a name must hold no `:`, and a path neither `:` nor `,`
//! (its last component could otherwise be taken for options); both are refused here rather than
//! passed on to be misread.

use std::net::Ipv4Addr;
use std::path::PathBuf;

/// One `--dir name:path[:ro]`: host folder `path` shared into the guest as `name` (in a macOS
/// guest: `/Volumes/My Shared Files/<name>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirShare {
    pub name: String,
    pub path: PathBuf,
    pub read_only: bool,
}

impl DirShare {
    /// The flag's value, `name:path` or `name:path:ro`; refused if tart would read it otherwise.
    pub fn render(&self) -> Result<String, String> {
        let path = self
            .path
            .to_str()
            .ok_or_else(|| format!("--dir path {:?} is not UTF-8", self.path))?;
        let bad_name = self.name.is_empty()
            || self
                .name
                .chars()
                .any(|c| c == ':' || c == '/' || c == ',' || c.is_control());
        if bad_name {
            return Err(format!(
                "--dir name {:?} must be non-empty without ':', '/', ',' or control characters",
                self.name
            ));
        }
        if !self.path.is_absolute() || path.chars().any(|c| c == ':' || c == ',' || c.is_control()) {
            return Err(format!(
                "--dir path {path:?} must be absolute, without ':', ',' or control characters (tart splits the flag at them)"
            ));
        }
        let ro = if self.read_only { ":ro" } else { "" };
        Ok(format!("{}:{path}{ro}", self.name))
    }
}

/// The VM's network.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Network {
    /// tart's default shared (NAT) network: no flag.
    #[default]
    Shared,
    /// Softnet isolation (`--net-softnet`): the guest reaches the internet but no private IPv4
    /// range (the Mac's LAN, other VMs) except the CIDRs in `allow` (`--net-softnet-allow=…`).
    Softnet { allow: Vec<Ipv4Cidr> },
}

/// An IPv4 network `a.b.c.d/len` with no host bits set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ipv4Cidr {
    pub addr: Ipv4Addr,
    pub len: u8,
}

impl std::fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl std::str::FromStr for Ipv4Cidr {
    type Err = String;

    /// Parses `a.b.c.d/len` (len 0–32). Host bits must be zero (`10.0.0.1/8` is refused, naming
    /// `10.0.0.0/8`), so what is written is what is allowed.
    fn from_str(s: &str) -> Result<Ipv4Cidr, String> {
        let shown: String = s.chars().take(64).collect();
        let bad = || format!("{shown:?} is not an IPv4 CIDR like 10.0.0.0/8");
        let (addr, len) = s.split_once('/').ok_or_else(bad)?;
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
        if len.is_empty() || len.len() > 2 || !len.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let len: u8 = len.parse().map_err(|_| bad())?;
        if len > 32 {
            return Err(format!("{shown:?}: the prefix length must be 0 to 32"));
        }
        let mask = if len == 0 { 0 } else { u32::MAX << (32 - u32::from(len)) };
        let network = Ipv4Addr::from(u32::from(addr) & mask);
        if network != addr {
            return Err(format!("{shown:?} has host bits set; write {network}/{len}"));
        }
        Ok(Ipv4Cidr { addr, len })
    }
}

/// The `tart run` flags for `dirs` and `network`, in that order.
pub fn run_args(dirs: &[DirShare], network: &Network) -> Result<Vec<String>, String> {
    let mut args = Vec::new();
    for d in dirs {
        args.push(format!("--dir={}", d.render()?));
    }
    if let Network::Softnet { allow } = network {
        args.push("--net-softnet".to_string());
        if !allow.is_empty() {
            let list: Vec<String> = allow.iter().map(Ipv4Cidr::to_string).collect();
            args.push(format!("--net-softnet-allow={}", list.join(",")));
        }
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(name: &str, path: &str, read_only: bool) -> DirShare {
        DirShare {
            name: name.into(),
            path: path.into(),
            read_only,
        }
    }

    #[test]
    fn dir_shares_render_as_tart_reads_them() {
        assert_eq!(
            share("spm", "/Users/ci/cache/spm", false).render().unwrap(),
            "spm:/Users/ci/cache/spm"
        );
        assert_eq!(
            share("seed", "/srv/seed dir", true).render().unwrap(),
            "seed:/srv/seed dir:ro"
        );
        for (name, path) in [
            ("", "/a"),
            ("a:b", "/a"),
            ("a/b", "/a"),
            ("a,ro", "/a"),
            ("a\n", "/a"),
            ("a", "relative"),
            ("a", "/x:y"),
            ("a", "/x/ro,tag=evil"),
            ("a", "/x\0y"),
        ] {
            assert!(share(name, path, false).render().is_err(), "{name:?} {path:?}");
        }
    }

    #[test]
    fn cidrs_are_strict_ipv4_networks() {
        for good in ["10.0.0.0/8", "192.168.1.0/24", "0.0.0.0/0", "1.2.3.4/32"] {
            assert_eq!(good.parse::<Ipv4Cidr>().unwrap().to_string(), good);
        }
        for (bad, why) in [
            ("10.0.0.1/8", "write 10.0.0.0/8"),
            ("10.0.0.0/33", "0 to 32"),
            ("10.0.0.0", "not an IPv4 CIDR"),
            ("10.0.0.0/", "not an IPv4 CIDR"),
            ("10.0.0.0/+8", "not an IPv4 CIDR"),
            ("10.0.0.0/008", "not an IPv4 CIDR"),
            ("::1/128", "not an IPv4 CIDR"),
            ("10.0.0/8", "not an IPv4 CIDR"),
            ("10.0.0.0/8,0.0.0.0/0", "not an IPv4 CIDR"),
            (" 10.0.0.0/8", "not an IPv4 CIDR"),
            ("", "not an IPv4 CIDR"),
        ] {
            let e = bad.parse::<Ipv4Cidr>().unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        assert!("9".repeat(10_000).parse::<Ipv4Cidr>().unwrap_err().len() < 200);
    }

    #[test]
    fn run_args_put_the_shares_then_the_network() {
        let allow = vec!["10.0.0.0/8".parse().unwrap(), "192.168.0.0/16".parse().unwrap()];
        assert_eq!(
            run_args(
                &[share("spm", "/c/spm", false), share("seed", "/c/seed", true)],
                &Network::Softnet { allow }
            )
            .unwrap(),
            [
                "--dir=spm:/c/spm",
                "--dir=seed:/c/seed:ro",
                "--net-softnet",
                "--net-softnet-allow=10.0.0.0/8,192.168.0.0/16"
            ]
        );
        assert_eq!(
            run_args(&[], &Network::Softnet { allow: vec![] }).unwrap(),
            ["--net-softnet"]
        );
        assert!(run_args(&[], &Network::Shared).unwrap().is_empty());
    }
}
