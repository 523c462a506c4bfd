import type { Sql } from "postgres";
import { createApiKey, listTenants, revokeTenant, tenantExists } from "../tenants/tenant_store.ts";
import { printRows } from "./table.ts";
import { allowDomain } from "../tenants/mail_domains.ts";

const USAGE =
  "Usage: deno task tenant create NAME | list [--json] | revoke NAME | allow-domain NAME DOMAIN | allow-domain NAME --any";

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
 * `tenant create NAME | list | revoke NAME`. `create` prints the new key as
 * the last line on stdout.
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
