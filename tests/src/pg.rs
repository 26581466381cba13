//! A PostgreSQL database of its own for one test (`TEST_DATABASE_URL`, default the local
//! server). A missing PostgreSQL fails the test.

use sqlx::Connection;

fn admin_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database of its own for one test run, dropped afterwards.
#[derive(Debug)]
pub struct PgDatabase {
    name: String,
}

impl PgDatabase {
    pub async fn create(tag: &str) -> (Self, String) {
        let admin = admin_url();
        let name = format!(
            "hearth_test_{tag}_{}_{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        );
        let mut c = sqlx::PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {admin} is required for this test: {e}"));
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut c)
            .await
            .expect("create test database");
        let base = admin
            .rsplit_once('/')
            .map_or(admin.as_str(), |(b, _)| b)
            .to_string();
        (Self { name: name.clone() }, format!("{base}/{name}"))
    }

    pub async fn drop_db(self) {
        let mut c = sqlx::PgConnection::connect(&admin_url())
            .await
            .expect("connect");
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&mut c)
        .await
        .expect("drop test database");
    }
}
