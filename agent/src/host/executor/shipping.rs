//! Log shipping: the step logs go to the build's artifact destination while the attempt runs
//! (started at its first host action, decided once), and their end is waited for, bounded, as
//! the VM is retired.

use std::time::Instant;

use super::AttemptExecutor;
use crate::host::artifacts::{DestinationPolicy, DestinationRefused, allowed_destination};
use crate::host::log_shipper::LogShipper;
use crate::host::steps::log_dir;

impl AttemptExecutor {
    /// Starts shipping the step logs unless that was decided already: to the build's artifact
    /// destination (`spec.artifacts.destination`, else the agent config's), if the policy allows
    /// it. With no destination at all nothing is shipped; a refused one is the artifacts'
    /// business (it fails the build at admission) and ships nothing either.
    pub(super) fn ensure_log_shipping(&mut self) {
        if self.log_shipping_decided {
            return;
        }
        self.log_shipping_decided = true;
        // A build gone from the cluster is only retired (its spec is a stand-in without steps).
        if self.attempt.spec.steps.is_empty() {
            return;
        }
        let named = self
            .attempt
            .spec
            .artifacts
            .as_ref()
            .map_or("", |a| a.destination.as_str());
        let home = self.tart.home().ok();
        let policy = DestinationPolicy::new(&self.cfg.artifacts, &self.cfg.state_dir, home.as_deref());
        let vm = self.attempt.vm.clone();
        match allowed_destination(named, &policy) {
            Ok(dest) => {
                let shipper = LogShipper::start(
                    &vm,
                    log_dir(&self.cfg.state_dir, &vm),
                    dest,
                    self.cfg.log_ship.clone(),
                    &self.cfg.artifacts,
                );
                self.logs_location = Some(shipper.location().to_string());
                self.log_shipper = Some(shipper);
            }
            Err(DestinationRefused::NoDestination) => {
                tracing::info!(%vm, "no artifact destination: the step logs stay on this host only");
            }
            Err(refused) => {
                tracing::warn!(%vm, %refused, "the step logs are not shipped; they stay on this host only");
            }
        }
    }

    /// Asks the shipper (if any) to ship its last bytes and the whole logs; [`Self::end_log_shipping`]
    /// waits for it. Called as the retirement starts, so it overlaps the VM's stop and deletion.
    pub(super) fn begin_log_shipping_end(&mut self) -> Instant {
        self.ensure_log_shipping();
        if let Some(s) = &self.log_shipper {
            s.begin_finish();
        }
        Instant::now()
    }

    /// Waits (bounded by [`ShipSettings::finish_limit`](crate::host::log_shipper::ShipSettings::finish_limit) since `since`) for the shipper's end.
    pub(super) async fn end_log_shipping(&mut self, since: Instant) {
        if let Some(s) = self.log_shipper.take() {
            s.finish(since, self.cfg.log_ship.finish_limit).await;
        }
    }
}
