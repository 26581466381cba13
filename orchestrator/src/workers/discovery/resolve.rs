//! Looking a name up: its A and AAAA records, asked of the system's resolvers
//! (`/etc/resolv.conf`, with its search domains) or of one server (`--dns-server`).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_resolver::config::{NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::lookup::Lookup;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::NetError;
use hickory_resolver::{Resolver, TokioResolver};

use super::state::{Answer, Records};

/// The resolver discovery asks.
pub(super) struct Lookups {
    resolver: TokioResolver,
}

impl std::fmt::Debug for Lookups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lookups").finish_non_exhaustive()
    }
}

impl Lookups {
    /// A resolver asking `server` (UDP, and TCP for long answers), or the system's resolvers.
    pub(super) fn new(server: Option<SocketAddr>) -> Result<Self, NetError> {
        let mut builder = match server {
            Some(addr) => {
                let mut ns = NameServerConfig::udp_and_tcp(addr.ip());
                for c in &mut ns.connections {
                    c.port = addr.port();
                }
                let config = ResolverConfig::from_name_servers(vec![ns]);
                let mut b = Resolver::builder_with_config(config, TokioRuntimeProvider::default());
                // That server alone answers, not /etc/hosts.
                b.options_mut().use_hosts_file = ResolveHosts::Never;
                b
            }
            None => TokioResolver::builder_tokio()?,
        };
        let opts = builder.options_mut();
        // Every refresh asks the server: an answer kept here for its TTL would hide a worker
        // that came or went (the server, or a node-local cache, honours TTLs already).
        opts.positive_max_ttl = Some(Duration::ZERO);
        opts.negative_max_ttl = Some(Duration::ZERO);
        Ok(Self {
            resolver: builder.build()?,
        })
    }

    /// `name`'s A and AAAA records, asked for together.
    pub(super) async fn answer(&self, name: &str) -> Answer {
        let (v4, v6) = tokio::join!(
            self.resolver.ipv4_lookup(name),
            self.resolver.ipv6_lookup(name)
        );
        Answer {
            v4: records(v4),
            v6: records(v6),
        }
    }
}

/// One record type's answer: addresses, a definite none (NXDOMAIN, or no such record), or a
/// failure.
fn records(r: Result<Lookup, NetError>) -> Records {
    match r {
        Ok(lookup) => {
            let ips: BTreeSet<IpAddr> = lookup
                .answers()
                .iter()
                .filter_map(|rec| rec.data.ip_addr())
                .collect();
            match ips.is_empty() {
                true => Records::Empty,
                false => Records::Found(ips),
            }
        }
        Err(e) if e.is_no_records_found() => Records::Empty,
        Err(e) => Records::Failed(e.to_string()),
    }
}
