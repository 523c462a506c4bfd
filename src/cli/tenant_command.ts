import type { Sql } from "postgres";
import { createApiKey, listTenants, revokeTenant, tenantExists } from "../tenants/tenant_store.ts";
import { printRows } from "./table.ts";
import { allowDomain } from "../tenants/mail_domains.ts";
import { allowWebhookHost } from "../tenants/webhook_hosts.ts";
import { ensureWebhookSecret, rotateWebhookSecret } from "../tenants/webhook_secrets.ts";
import { parseTenantWeight, setTenantWeight, TENANT_WEIGHTS_TTL_MS } from "../tenants/tenant_weights.ts";

const USAGE = "Usage: deno task tenant create NAME | list [--json] | revoke NAME | rotate-webhook-secret NAME" +
  " | allow-domain NAME DOMAIN | allow-domain NAME --any | allow-webhook-host NAME HOST" +
  " | allow-webhook-host NAME --any | set NAME --weight N";

/** Runs `command`; a bad argument (a `TypeError` from validation) is printed and exits 2. */
async function usageErrorsAs2(command: () => Promise<number>): Promise<number> {
  try {
    return await command();
  } catch (error) {
    if (!(error instanceof TypeError)) throw error;
    console.error(error.message);
    return 2;
  }
}

/**
 * `tenant create NAME | list | revoke NAME | rotate-webhook-secret NAME |
 * allow-domain | allow-webhook-host | set NAME --weight N`. `create` prints the new key as the
 * last line on stdout, and before it, for a new tenant, its webhook signing
 * secret.
 * @returns the process exit code.
 */
export async function tenantCommand(sql: Sql, args: string[], out = console.log): Promise<number> {
  const [action, name] = args;
  const json = args.includes("--json");
  switch (action) {
    case "create": {
      if (!name) break;
      return await usageErrorsAs2(async () => {
        const key = await createApiKey(sql, name);
        const secret = await ensureWebhookSecret(sql, name);
        if (secret) {
          out(`Webhook signing secret of tenant "${name}" (receivers verify webhooks with it; shown once):`);
          out(secret);
        }
        out(`Created an API key for tenant "${name}". Store it now; it cannot be shown again.`);
        out(key);
        return 0;
      });
    }
    case "list": {
      const rows = await listTenants(sql);
      printRows(
        rows.map((r) => ({
          name: r.name,
          weight: r.weight,
          active_keys: r.active_keys,
          revoked_keys: r.revoked_keys,
          created_at: r.created_at.toISOString(),
        })),
        { json, out, empty: "No tenants yet. Create one with: deno task tenant create NAME" },
      );
      return 0;
    }
    case "allow-domain": {
      const domain = args[2];
      if (!name || !domain) break;
      if (!(await tenantExists(sql, name))) {
        console.error(`No tenant named ${JSON.stringify(name)}`);
        return 1;
      }
      return await usageErrorsAs2(async () => {
        const domains = await allowDomain(sql, name, domain === "--any" ? null : domain);
        out(
          domains.length
            ? `Tenant "${name}" may email only: ${domains.join(", ")} (within 10 seconds).`
            : `Tenant "${name}" may email any domain (within 10 seconds).`,
        );
        return 0;
      });
    }
    case "allow-webhook-host": {
      const host = args[2];
      if (!name || !host) break;
      if (!(await tenantExists(sql, name))) {
        console.error(`No tenant named ${JSON.stringify(name)}`);
        return 1;
      }
      return await usageErrorsAs2(async () => {
        const hosts = await allowWebhookHost(sql, name, host === "--any" ? null : host);
        out(
          hosts.length
            ? `Tenant "${name}" may send webhooks only to: ${hosts.join(", ")} (within 10 seconds).`
            : `Tenant "${name}" may send webhooks to any host (within 10 seconds).`,
        );
        return 0;
      });
    }
    case "set": {
      // One setting for now: `set NAME --weight N` (or `--weight=N`).
      const rest = args.slice(2);
      const value = rest.length === 2 && rest[0] === "--weight"
        ? rest[1]
        : rest.length === 1 && rest[0]!.startsWith("--weight=")
        ? rest[0]!.slice("--weight=".length)
        : undefined;
      if (!name || value === undefined) break;
      let weight: number;
      try {
        weight = parseTenantWeight(value);
      } catch (error) {
        if (!(error instanceof TypeError)) throw error;
        console.error(error.message);
        console.error(USAGE);
        return 2;
      }
      if (!(await setTenantWeight(sql, name, weight))) {
        console.error(`No tenant named ${JSON.stringify(name)}`);
        return 1;
      }
      out(
        `Tenant "${name}" has weight ${weight} in the fair share of the model provider ` +
          `(workers use it within ${TENANT_WEIGHTS_TTL_MS / 1000} seconds).`,
      );
      return 0;
    }
    case "rotate-webhook-secret": {
      if (!name) break;
      if (!(await tenantExists(sql, name))) {
        console.error(`No tenant named ${JSON.stringify(name)}`);
        return 1;
      }
      const secret = await rotateWebhookSecret(sql, name);
      out(
        `New webhook signing secret of tenant "${name}" (shown once). For 24 hours webhooks carry signatures ` +
          `by both the old and the new secret, so receivers can switch without missing a delivery:`,
      );
      out(secret);
      return 0;
    }
    case "revoke": {
      if (!name) break;
      if (!(await tenantExists(sql, name))) {
        console.error(`No tenant named ${JSON.stringify(name)}`);
        return 1;
      }
      const n = await revokeTenant(sql, name);
      out(`Revoked ${n} key(s) of tenant "${name}". Cached keys stop working within 10 seconds.`);
      return 0;
    }
  }
  console.error(USAGE);
  return 2;
}
